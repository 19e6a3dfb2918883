"""RaggedShard: a DTensor placement of contiguous blocks of any size, uneven per rank.

Importing this package changes nothing in torch. The first ``RaggedShard`` constructed installs
a narrowly scoped, checked integration into torch's DTensor (``ragged_dtensor._private.compat``)
so that ``redistribute``, ``full_tensor``, elementwise ops, optimizers, ``clip_grad_norm_`` and
``torch.distributed.checkpoint`` accept RaggedShard; ``install_dtensor_integration()`` /
``uninstall_dtensor_integration()`` / ``with dtensor_integration():`` do it explicitly and remove
it. Build ragged DTensors with this package's ``distribute_tensor`` and ``from_local``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ragged_dtensor._private.agreement import (
    RanksDisagreeError,
    check_ranks_agree,
    describe_disagreement,
    gather_records_if_different,
)
from ragged_dtensor._private.api import (
    distribute_tensor,
    from_local,
    local_box,
    local_range,
    redistribute,
)
from ragged_dtensor._private.compat import (
    DTensorIntegrationError,
    dtensor_integration,
    dtensor_integration_installed,
    hooks_installed,
    install_dtensor_integration,
    uninstall_dtensor_integration,
)
from ragged_dtensor._private.debug import (
    CollectiveMismatchError,
    collective_checks,
    collective_checks_enabled,
)
from ragged_dtensor._private.fallback import RaggedOpError, is_strict, set_strict, strict_mode
from ragged_dtensor._private.geometry import FlatRange, flat_range_to_boxes
from ragged_dtensor._private.placement import RaggedShard
from ragged_dtensor._private.redistribute import RedistributeStep, StepKind, plan_redistribute
from ragged_dtensor._private.views import own_storage_view, storage_base

try:
    __version__ = version("ragged-dtensor")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "RaggedShard",
    "RaggedOpError",
    # ops without a ragged rule redistribute implicitly, unless strict
    "set_strict",
    "is_strict",
    "strict_mode",
    # torch-DTensor operations, spelled explicitly
    "distribute_tensor",
    "from_local",
    "redistribute",
    # geometry
    "FlatRange",
    "flat_range_to_boxes",
    "local_box",
    "local_range",
    # plan / execute
    "RedistributeStep",
    "StepKind",
    "plan_redistribute",
    # the DTensor integration (installed by the first RaggedShard; nothing at import)
    "install_dtensor_integration",
    "uninstall_dtensor_integration",
    "dtensor_integration",
    "dtensor_integration_installed",
    "hooks_installed",
    "DTensorIntegrationError",
    # rank agreement (one mechanism for every package)
    "RanksDisagreeError",
    "check_ranks_agree",
    "describe_disagreement",
    "gather_records_if_different",
    # collective debug mode (collective_checks(), or RAGGED_DTENSOR_DEBUG_COLLECTIVES=1)
    "CollectiveMismatchError",
    "collective_checks",
    "collective_checks_enabled",
    # local shards over storage of their own (serialize and copy as their own elements)
    "own_storage_view",
    "storage_base",
    "__version__",
]
