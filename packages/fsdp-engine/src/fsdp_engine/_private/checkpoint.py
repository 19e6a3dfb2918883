"""The checkpoint API of fsdp_engine, one import for its modules.

- ``checkpoint_save``: ``save_checkpoint`` and the commit protocol ([Note: commit protocol]);
- ``checkpoint_async``: ``async_save_checkpoint``, its handle and its writer thread;
- ``checkpoint_staging``: copying a state dict off the training tensors ([Note: staging]);
- what torch's copying code (DCP's stagers, ``copy.deepcopy``, ``torch.save``) needs of the
  engine's DTensors: local tensors over storage of their own ([Note: DTensors over views] in
  compat);
- ``checkpoint_load``: ``load_checkpoint``, ``verify_checkpoint`` ([Note: strict loading]);
- ``checkpoint_discovery``: ``latest_checkpoint``, ``checkpoint_info``,
  ``is_complete_checkpoint``;
- ``checkpoint_checks``: what every rank checks and agrees on first ([Note: per-rank plain
  tensors]);
- ``checkpoint_files``: the per-range digests written and verified through DCP ([Note:
  integrity]); ``checkpoint_errors``: the errors; ``checkpoint_common``: shared helpers.
"""

from __future__ import annotations

from fsdp_engine._private.checkpoint_async import AsyncSaveHandle, async_save_checkpoint
from fsdp_engine._private.checkpoint_common import COMMIT_MARKER
from fsdp_engine._private.checkpoint_discovery import (
    checkpoint_info,
    is_complete_checkpoint,
    latest_checkpoint,
)
from fsdp_engine._private.checkpoint_errors import (
    AfterCommitError,
    CheckpointError,
    CheckpointIntegrityError,
    IncompleteCheckpointError,
)
from fsdp_engine._private.checkpoint_load import load_checkpoint, verify_checkpoint
from fsdp_engine._private.checkpoint_save import save_checkpoint

__all__ = [
    "COMMIT_MARKER",
    "AfterCommitError",
    "AsyncSaveHandle",
    "CheckpointError",
    "CheckpointIntegrityError",
    "IncompleteCheckpointError",
    "async_save_checkpoint",
    "checkpoint_info",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]
