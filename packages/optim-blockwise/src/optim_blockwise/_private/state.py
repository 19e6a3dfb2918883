"""``state_dict`` / ``load_state_dict`` for optimizers that keep local state of sharded params.

[Note: sharded state in the state dict]
Internally the optimizers keep every state tensor as this rank's flat *local* piece (the
arithmetic is local). A checkpoint needs more: ``torch.distributed.checkpoint`` treats a plain
tensor as replicated and would keep one rank's copy only. So ``state_dict()`` wraps each state
tensor of a DTensor parameter in a DTensor (zero-copy views of the same storage):

- per-element state (moments, momentum, 8-bit codes): the parameter's own placements, global
  shape and local shape, so DCP can reshard it to any other layout or world size;
- per-block absmaxes: a 1-D tensor, ``RaggedShard((0,), blocks per rank)`` on the sharding axis.
  With block-aligned shards this is exactly the global absmax vector (reshardable between
  aligned layouts); when shards cut blocks, the shared edge blocks appear once per holder, so
  the global length depends on the layout and loading into another layout fails with DCP's
  shape error instead of silently mixing blocks.
- ``step`` stays a plain scalar tensor (equal on every rank).

``load_state_dict`` accepts both forms and keeps the state dtypes: torch's
``Optimizer.load_state_dict`` would cast every state tensor to the parameter's dtype, turning
uint8 codes into floats and rounding fp32 moments of bf16 parameters, so the state tensors are
kept out of torch's load and restored here, moved to the parameter's device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from optim_blockwise._private.layout import describe
from ragged_dtensor import RaggedShard, from_local

__all__ = ["sharded_state_dict", "restore_state_dtypes"]


def _param_pairs(
    groups_saved: list[dict[str, Any]], params_groups: list[dict[str, Any]]
) -> Iterator[tuple[Any, torch.Tensor]]:
    ids = itertools.chain.from_iterable(g["params"] for g in groups_saved)
    params = itertools.chain.from_iterable(g["params"] for g in params_groups)
    yield from zip(ids, params, strict=True)


def _wrap(key: str, value: torch.Tensor, param: DTensor, block_size: int | None) -> torch.Tensor:
    local_param = param.to_local()
    if key == "step" or value.dim() == 0:
        return value
    if key.endswith("_absmax"):
        assert block_size is not None
        layout = describe(param, "state")
        units = []
        for lo, hi in layout.ranges:
            units.append(-(-hi // block_size) - lo // block_size if hi > lo else 0)
        axis = next(i for i, p in enumerate(param.placements) if not isinstance(p, Replicate))
        placements: list[Placement] = [Replicate()] * len(param.placements)
        placements[axis] = RaggedShard((0,), tuple(units))
        return from_local(
            value,
            param.device_mesh,
            placements,
            shape=torch.Size([sum(units)]),
            stride=(1,),
            run_check=False,
        )
    if value.numel() != local_param.numel():
        return value  # not per-element: leave as is
    return from_local(  # also a 0-d ragged parameter (torch's takes shape=() as "not given")
        value.view(local_param.shape),
        param.device_mesh,
        param.placements,
        shape=param.shape,
        stride=param.stride(),
        run_check=False,
    )


def sharded_state_dict(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    block_size: int | None = None,
) -> dict[str, Any]:
    """Wrap the local state of DTensor params of ``state_dict`` (torch's format) in DTensors."""
    state: dict[Any, dict[str, Any]] = state_dict["state"]
    wrapped: dict[Any, dict[str, Any]] = {}
    for pid, param in _param_pairs(state_dict["param_groups"], optimizer.param_groups):
        entry = state.get(pid)
        if entry is None:
            continue
        if not isinstance(param, DTensor) or not any(
            not isinstance(p, Replicate) for p in param.placements
        ):
            wrapped[pid] = entry
            continue
        wrapped[pid] = {
            k: _wrap(k, v, param, block_size) if isinstance(v, torch.Tensor) else v
            for k, v in entry.items()
        }
    return {**state_dict, "state": wrapped}


def restore_state_dtypes(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    """Load param groups with torch's ``load`` and the state tensors exactly, as local tensors."""
    saved_state: dict[Any, dict[str, Any]] = state_dict["state"]
    # torch's load sees only the non-tensor state: nothing for it to cast.
    load(
        {
            **state_dict,
            "state": {
                pid: {k: v for k, v in entry.items() if not isinstance(v, torch.Tensor)}
                for pid, entry in saved_state.items()
            },
        }
    )
    for pid, param in _param_pairs(state_dict["param_groups"], optimizer.param_groups):
        saved = saved_state.get(pid)
        if saved is None:
            continue
        target = optimizer.state[param]
        for key, value in saved.items():
            if not isinstance(value, torch.Tensor):
                continue
            local = value.to_local() if isinstance(value, DTensor) else value
            if key != "step":
                local = local.reshape(-1)
                device = (param.to_local() if isinstance(param, DTensor) else param).device
            else:
                device = local.device
            target[key] = local.detach().to(device=device, copy=True)
