"""RaggedShard: a DTensor placement of contiguous blocks of any size, uneven per rank.

Importing this package installs narrowly scoped hooks into torch's DTensor (see
``ragged_dtensor._private.compat``) so that torch's own ``distribute_tensor``,
``DTensor.from_local(..., shape=)``, ``redistribute``, ``full_tensor``, elementwise ops, optimizers,
``clip_grad_norm_`` and ``torch.distributed.checkpoint`` accept RaggedShard. Import it before use.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ragged_dtensor._private import compat as _compat
from ragged_dtensor._private import debug as _debug
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
from ragged_dtensor._private.compat import hooks_installed
from ragged_dtensor._private.debug import CollectiveMismatchError, collective_checks_enabled
from ragged_dtensor._private.geometry import FlatRange, flat_range_to_boxes
from ragged_dtensor._private.ops import RaggedOpError
from ragged_dtensor._private.placement import RaggedShard
from ragged_dtensor._private.redistribute import RedistributeStep, StepKind, plan_redistribute

_compat.install()
_debug.install_from_env()  # RAGGED_DTENSOR_DEBUG_COLLECTIVES=1: check every collective

try:
    __version__ = version("ragged-dtensor")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "RaggedShard",
    "RaggedOpError",
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
    "hooks_installed",
    # rank agreement (one mechanism for every package)
    "RanksDisagreeError",
    "check_ranks_agree",
    "describe_disagreement",
    "gather_records_if_different",
    # collective debug mode (RAGGED_DTENSOR_DEBUG_COLLECTIVES=1)
    "CollectiveMismatchError",
    "collective_checks_enabled",
    "__version__",
]
