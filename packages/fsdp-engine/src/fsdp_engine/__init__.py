"""fsdp_engine: ``fully_shard``, a drop-in for torch FSDP2 built on RaggedShard, the planner and
DBuffer.

Switching from torch's FSDP2 is an import change::

    from fsdp_engine import fully_shard, MixedPrecisionPolicy

and for code that imports FSDP2 itself (a trainer), one line that is undone as easily::

    fsdp_engine.use_as_torch_fsdp()      # or: with fsdp_engine.as_torch_fsdp(): ...
    fsdp_engine.restore_torch_fsdp()
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fsdp_engine._private.api import (
    BlockPolicy,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedAllGather,
    QuantizedWeight,
)
from fsdp_engine._private.checkpoint import (
    AfterCommitError,
    AsyncSaveHandle,
    CheckpointError,
    CheckpointIntegrityError,
    IncompleteCheckpointError,
    async_save_checkpoint,
    checkpoint_info,
    is_complete_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from fsdp_engine._private.export import load_full_state_dict
from fsdp_engine._private.fsdp_module import (
    FSDPModule,
    UnshardHandle,
    register_fsdp_forward_method,
    share_comm_ctx,
)
from fsdp_engine._private.fully_shard import fully_shard
from fsdp_engine._private.replaced import ReplacedParameterWarning
from fsdp_engine._private.runtime_checks import NonFiniteGradientError
from fsdp_engine._private.switch import (
    TorchFSDPSwitchError,
    as_torch_fsdp,
    restore_torch_fsdp,
    use_as_torch_fsdp,
    used_as_torch_fsdp,
)

try:
    __version__ = version("fsdp-engine")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "BlockPolicy",
    "use_as_torch_fsdp",
    "restore_torch_fsdp",
    "as_torch_fsdp",
    "used_as_torch_fsdp",
    "TorchFSDPSwitchError",
    "QuantizedAllGather",
    "QuantizedWeight",
    "save_checkpoint",
    "async_save_checkpoint",
    "AsyncSaveHandle",
    "load_checkpoint",
    "latest_checkpoint",
    "is_complete_checkpoint",
    "checkpoint_info",
    "verify_checkpoint",
    "load_full_state_dict",
    "CheckpointError",
    "CheckpointIntegrityError",
    "IncompleteCheckpointError",
    "AfterCommitError",
    "NonFiniteGradientError",
    "ReplacedParameterWarning",
    "__version__",
]
