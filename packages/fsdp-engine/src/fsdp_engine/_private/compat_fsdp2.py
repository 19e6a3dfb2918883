"""The names of torch's FSDP2 and DTensor internals that per-parameter meshes, tensor-parallel
placements and pipeline stages use (torch 2.13; the rest of the engine's: ``compat``).

- torch's composable-state slot: where torch's own ``fully_shard.state(module)`` looks, so that
  torch code holding torch's ``fully_shard`` (``torch.distributed.pipelining``'s stage) finds our
  state ([Note: pipeline stages] in ``pipelining``);
- ``ShardPlacementResult``: what ``shard_placement_fn`` returns to put a parameter on a mesh of
  its own ([Note: per-parameter meshes] in ``param_meshes``);
- ``_StridedShard``: FSDP2's data-parallel placement of a dim tensor parallelism also shards
  ([Note: placed groups] in ``placed``).

Each is looked up once, at import; ``compat.compat_status()`` reports them with the others and
``test_engine_compat.py`` checks each is torch's object.
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn
from torch.distributed.tensor import Placement, Shard

__all__ = [
    "STATUS",
    "is_shard_like",
    "register_torch_state",
    "shard_placement_result_type",
    "strided_shard",
]

STATUS: dict[str, str] = {}


def _torch_state_slot() -> tuple[str, Any] | None:
    """Where torch's ``fully_shard.state(module)`` looks: ``module.__dict__[STATE_KEY]``, keyed
    by the function its ``contract`` decorator wrapped (checked here by a lookup through torch's
    own ``state``)."""
    try:
        contract = importlib.import_module("torch.distributed._composable.contract")
        impl = importlib.import_module("torch.distributed.fsdp._fully_shard._fully_shard")
    except ImportError:  # pragma: no cover
        return None
    key, torch_fully_shard = getattr(contract, "STATE_KEY", None), impl.fully_shard
    func = getattr(torch_fully_shard, "__wrapped__", None)
    lookup = getattr(torch_fully_shard, "state", None)
    if not isinstance(key, str) or func is None or lookup is None:
        return None  # pragma: no cover
    probe, marker = nn.Module(), object()
    probe.__dict__[key] = {func: marker}
    return (key, func) if lookup(probe) is marker else None


_TORCH_STATE_SLOT = _torch_state_slot()
STATUS["torch_state_slot"] = "registered" if _TORCH_STATE_SLOT is not None else "unavailable"


def _shard_placement_result() -> type | None:
    try:
        common = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_common")
    except ImportError:  # pragma: no cover
        return None
    cls = getattr(common, "ShardPlacementResult", None)
    return cls if isinstance(cls, type) else None


_SHARD_PLACEMENT_RESULT = _shard_placement_result()
STATUS["shard_placement_result"] = "torch" if _SHARD_PLACEMENT_RESULT is not None else "missing"


def shard_placement_result_type() -> type | None:
    """FSDP2's ``ShardPlacementResult`` (what ``shard_placement_fn`` returns to put a parameter
    on a mesh of its own), or None where torch has none."""
    return _SHARD_PLACEMENT_RESULT


def _strided_shard_type() -> Any:
    try:
        types = importlib.import_module("torch.distributed.tensor.placement_types")
    except ImportError:  # pragma: no cover
        return None
    return getattr(types, "_StridedShard", None)


_STRIDED_SHARD = _strided_shard_type()
STATUS["strided_shard"] = "torch" if _STRIDED_SHARD is not None else "missing"


def strided_shard(dim: int, split_factor: int) -> Placement:
    """DTensor's ``_StridedShard(dim, split_factor)``: FSDP2's data-parallel placement of a
    dim that tensor parallelism also shards (the data-parallel chunks interleave with the
    tensor-parallel ones)."""
    if _STRIDED_SHARD is None:  # pragma: no cover
        raise NotImplementedError("this torch has no _StridedShard placement")
    placement: Placement = _STRIDED_SHARD(dim, split_factor=split_factor)
    return placement


def is_shard_like(placement: Placement, dim: int) -> bool:
    """``Shard(dim)`` or ``_StridedShard(dim, ...)`` (DTensor's ``num_shards_map`` counts both)."""
    if isinstance(placement, Shard):
        return placement.dim == dim
    return (
        _STRIDED_SHARD is not None
        and isinstance(placement, _STRIDED_SHARD)
        and (placement.dim == dim)
    )


def register_torch_state(module: nn.Module, state: object) -> None:
    """Make torch's ``fully_shard.state(module)`` return ``state`` (ours): torch code that
    imported torch's ``fully_shard`` (``torch.distributed.pipelining``'s stage) finds our state
    as it finds FSDP2's ([Note: pipeline stages] in ``pipelining``)."""
    if _TORCH_STATE_SLOT is None:  # pragma: no cover
        return
    key, func = _TORCH_STATE_SLOT
    module.__dict__.setdefault(key, {})[func] = state
