"""Where a parameter's local data lies in its global tensor: one flat range per rank of one axis.

[Note: one description for every sharding]
Both optimizers work on local tensors and do their own communication, so all they need to know
about a parameter is: its global shape, the process group of the mesh axis that shards it, this
rank's coordinate on that axis, and the flat row-major range ``[start, stop)`` of the global
tensor that every coordinate holds. Three kinds of parameter map onto that:

- a plain tensor: one "rank" holding ``[0, numel)``, no group;
- a ``RaggedShard`` DTensor: the ranges are the placement's geometry;
- a torch FSDP2 ``Shard(0)`` DTensor: ``torch.chunk`` semantics (``ceil(rows / m)`` rows to each
  leading rank, possibly none to the last), which is also one contiguous flat range per rank.

Other mesh axes may be ``Replicate`` (HSDP): the replicas then compute identical results
redundantly. Tensor-parallel ``Shard(d)`` on another axis, ``Partial`` and several sharded axes
are rejected with an error naming the parameter: their local data is not one flat range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ragged_dtensor import RaggedShard

__all__ = ["ParamLayout", "describe", "local_flat", "chunk_ranges"]


@attrs.frozen(eq=False)
class ParamLayout:
    """The flat ranges of one parameter over the ranks of its sharding axis."""

    global_shape: tuple[int, ...]
    ranges: tuple[tuple[int, int], ...]
    """``[start, stop)`` of the global row-major storage held by each coordinate of the axis."""
    coord: int
    """This rank's coordinate on the axis (index into ``ranges``)."""
    group: dist.ProcessGroup | None
    """Process group of the sharding axis; ``None`` for a plain (unsharded) tensor."""
    placement: str
    """Human-readable description of the sharding, for error messages."""

    @property
    def numel(self) -> int:
        return math.prod(self.global_shape)

    @property
    def start(self) -> int:
        return self.ranges[self.coord][0]

    @property
    def stop(self) -> int:
        return self.ranges[self.coord][1]

    @property
    def local_numel(self) -> int:
        return self.stop - self.start

    @property
    def world(self) -> int:
        return len(self.ranges)

    @property
    def is_sharded(self) -> bool:
        return self.group is not None and self.world > 1


def chunk_ranges(shape: Sequence[int], world: int) -> tuple[tuple[int, int], ...]:
    """Flat ranges of ``Shard(0)`` with ``torch.chunk`` semantics (FSDP2's default sharding)."""
    rows = shape[0] if shape else 1
    row_numel = math.prod(shape[1:]) if shape else 1
    per = -(-rows // world) if rows else 0
    out = []
    for k in range(world):
        lo, hi = min(k * per, rows), min((k + 1) * per, rows)
        out.append((lo * row_numel, hi * row_numel))
    return tuple(out)


def describe(param: torch.Tensor, name: str) -> ParamLayout:
    """The ``ParamLayout`` of a plain tensor, a RaggedShard DTensor or an FSDP2 Shard(0) DTensor."""
    if not isinstance(param, DTensor):
        shape = tuple(param.shape)
        return ParamLayout(shape, ((0, math.prod(shape)),), 0, None, "plain tensor")
    shape = tuple(param.shape)
    mesh = param.device_mesh
    sharded: list[int] = []
    for axis, placement in enumerate(param.placements):
        if isinstance(placement, RaggedShard) or (type(placement) is Shard and placement.dim == 0):
            sharded.append(axis)
        elif not isinstance(placement, Replicate):
            raise ValueError(
                f"parameter {name!r}: placement {placement!r} on mesh axis {axis} is not "
                f"supported; expected RaggedShard or Shard(0) on one axis and Replicate on the "
                f"others (placements {tuple(param.placements)})"
            )
    if len(sharded) > 1:
        raise ValueError(
            f"parameter {name!r}: sharded on mesh axes {sharded} (placements "
            f"{tuple(param.placements)}); at most one axis may shard a parameter"
        )
    if not sharded:
        numel = math.prod(shape)
        return ParamLayout(shape, ((0, numel),), 0, None, f"{tuple(param.placements)}")
    axis = sharded[0]
    placement = param.placements[axis]
    world = mesh.size(axis)
    coord = mesh.get_local_rank(axis)
    if isinstance(placement, RaggedShard):
        placement.validate(shape, where=f"parameter {name!r}")
        if placement.num_ranks != world:
            raise ValueError(
                f"parameter {name!r}: {placement!r} has {placement.num_ranks} units entries but "
                f"mesh axis {axis} has {world} ranks"
            )
        ranges = tuple(
            (r.start, r.stop) for r in (placement.flat_range(shape, k) for k in range(world))
        )
    else:
        ranges = chunk_ranges(shape, world)
    layout = ParamLayout(
        shape, ranges, coord, mesh.get_group(axis), f"{placement!r} on axis {axis}"
    )
    local = param.to_local()
    if local.numel() != layout.local_numel:
        raise ValueError(
            f"parameter {name!r}: rank {coord} of mesh axis {axis} holds {local.numel()} "
            f"elements but {placement!r} of shape {shape} gives it {layout.local_numel}"
        )
    return layout


def local_flat(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """The local data of ``tensor`` (a DTensor's ``to_local()``) as a flat view (no copy)."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if not local.is_contiguous():
        raise ValueError(
            f"parameter {name!r}: local tensor of shape {tuple(local.shape)} is not contiguous; "
            f"the optimizers update local data in place through a flat view"
        )
    return local.view(-1)
