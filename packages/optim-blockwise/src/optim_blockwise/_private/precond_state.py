"""Shampoo/SOAP's per-tile state in state dicts: each tile's state is a DTensor held whole by
its owner (``RaggedShard`` with a one-hot share), so distributed checkpointing reshards it; after
a load each rank keeps the blocks it owns. See ``preconditioner``'s notes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from optim_blockwise._private.layout import ParamLayout
from optim_blockwise._private.precond_plan import Blocks, StateSpec, block_key
from optim_blockwise._private.tiles import Tile
from ragged_dtensor import RaggedShard, from_local

__all__ = ["block_entries", "restore_blocks", "saved_pairs"]


def block_entries(
    spec: Callable[[dict[str, Any], Tile], StateSpec],
    group: dict[str, Any],
    param: torch.Tensor,
    blocks: Blocks,
    have: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    sharded = isinstance(param, DTensor) and any(
        not isinstance(p, Replicate) for p in param.placements
    )
    out: dict[str, torch.Tensor] = {}
    device = (param.to_local() if isinstance(param, DTensor) else param).device
    for t, tile in enumerate(blocks.tiles):
        for name, (shape, dtype) in spec(group, tile).items():
            key = block_key(t, name)
            value = have.get(key)
            if not sharded:
                if value is not None:
                    out[key] = value
                continue
            assert isinstance(param, DTensor)
            local = (
                value.reshape(-1)
                if value is not None
                else torch.empty(0, dtype=dtype, device=device)
            )
            axis = next(a for a, p in enumerate(param.placements) if not isinstance(p, Replicate))
            onehot = tuple(int(k == blocks.owners[t]) for k in range(param.device_mesh.size(axis)))
            placements: list[Placement] = [Replicate()] * len(param.placements)
            placements[axis] = RaggedShard((), onehot)
            out[key] = from_local(
                local,
                param.device_mesh,
                placements,
                shape=torch.Size(shape),
                stride=_contiguous_stride(shape),
                run_check=False,
            )
    return out


def restore_blocks(
    spec: Callable[[dict[str, Any], Tile], StateSpec],
    restore_layout: Callable[[str, torch.Tensor], torch.Tensor],
    group: dict[str, Any],
    blocks: Blocks,
    layout: ParamLayout,
    state: dict[str, Any],
) -> None:
    """After a load: keep this rank's own blocks of a parameter, in their step layout."""
    coord = layout.coord if layout.is_sharded else 0
    for t, tile in enumerate(blocks.tiles):
        for name, (shape, _dtype) in spec(group, tile).items():
            key = block_key(t, name)
            if key not in state:
                continue
            value = state[key]
            if value.numel() == 0 or blocks.owners[t] != coord:
                del state[key]  # another rank's block
                continue
            if value.numel() != math.prod(shape):
                raise ValueError(
                    f"optimizer state {key!r}: {value.numel()} elements, expected "
                    f"shape {shape} (was the checkpoint saved with another "
                    f"max_preconditioner_dim?)"
                )
            state[key] = restore_layout(name, value.view(shape))


def saved_pairs(
    param_groups: list[dict[str, Any]], saved_groups: list[dict[str, Any]]
) -> list[tuple[Any, dict[str, Any], Any]]:
    """``(saved id, group, param)`` of every parameter, in param group order."""
    params = [(g, p) for g in param_groups for p in g["params"]]
    ids = [pid for g in saved_groups for pid in g["params"]]
    return [(pid, group, param) for pid, (group, param) in zip(ids, params, strict=True)]


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
