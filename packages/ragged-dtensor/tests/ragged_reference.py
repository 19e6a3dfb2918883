"""Reference layouts built by slicing the global tensor (what every redistribution must equal)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor.placement_types import Placement, Shard

from ragged_dtensor import RaggedShard


def mesh_coordinate(rank: int, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    coord = []
    for size in reversed(mesh_shape):
        coord.append(rank % size)
        rank //= size
    return tuple(reversed(coord))


def reference_local(
    full: torch.Tensor, mesh_shape: Sequence[int], placements: Sequence[Placement], rank: int
) -> torch.Tensor:
    """The local tensor rank ``rank`` must hold: standard placements first, ragged innermost."""
    coord = mesh_coordinate(rank, mesh_shape)
    x = full
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = list(torch.chunk(x, mesh_shape[axis], dim=p.dim))
            while len(chunks) < mesh_shape[axis]:
                empty = list(x.shape)
                empty[p.dim] = 0
                chunks.append(x.new_empty(empty))
            x = chunks[coord[axis]]
    for axis, p in enumerate(placements):
        if isinstance(p, RaggedShard):
            r = p.flat_range(tuple(x.shape), coord[axis])
            x = x.reshape(-1)[r.start : r.stop]
    return x.contiguous()


def valid_units_total(shape: Sequence[int], dims: Sequence[int]) -> list[int]:
    """Every sum of local_units that divides the prefix rows of ``dims``."""
    rows = math.prod(shape[d] for d in dims)
    if rows == 0:
        return [1, 2, 3]
    return [t for t in range(1, rows + 1) if rows % t == 0]
