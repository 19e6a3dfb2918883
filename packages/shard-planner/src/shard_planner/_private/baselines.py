"""Peer layouts, computed on the same inputs as the planner for comparison.

[Note: the three baselines]
- ``naive``: concatenate in model order, round each tensor's start up to a multiple of its own
  block, and make S a multiple of ``lcm(align, all blocks)``. Every boundary is then a multiple of
  every block and every start is too, so no block is cut. The obvious "just round it" layout.
- ``megatron``: Megatron-FSDP's experimental layout as described publicly: a chunk
  ``C = lcm(align, all blocks)`` (block = rows x row length) and every tensor starting at a multiple
  of ``C``, shard size a multiple of ``C``.
- ``fsdp2``: FSDP2's per-parameter even split of dim 0, ``torch.chunk`` style: every rank stores
  ``ceil(dim0 / m)`` rows of every tensor (padding included), whatever the blocks. Not a single
  flat layout and it may cut blocks, so it is reported as figures, not as a ``Plan``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from shard_planner._private.bounds import round_up
from shard_planner._private.plan import Plan
from shard_planner._private.spec import TensorSpec, check_inputs

__all__ = ["Fsdp2Layout", "fsdp2_layout", "megatron_plan", "naive_plan"]


def _aligned_concat(specs: Sequence[TensorSpec], units: Sequence[int]) -> tuple[list[int], int]:
    offsets: list[int] = []
    p = 0
    for spec, unit in zip(specs, units, strict=True):
        if spec.numel == 0:
            offsets.append(p)
            continue
        p = round_up(p, unit)
        offsets.append(p)
        p += spec.numel
    return offsets, p


def _finish(
    specs: Sequence[TensorSpec],
    world_size: int,
    align: int,
    *,
    step: int,
    offsets: list[int],
    end: int,
    method: str,
) -> Plan:
    shard = max(round_up(-(-end // world_size), step), step)
    capacity = world_size * shard
    offsets = [
        min(o, capacity - 1) if s.numel == 0 else o for o, s in zip(offsets, specs, strict=True)
    ]
    order = tuple(sorted(range(len(specs)), key=lambda i: (offsets[i], i)))
    return Plan(
        world_size=world_size,
        shard_size=shard,
        align=align,
        numels=tuple(s.numel for s in specs),
        blocks=tuple(s.block for s in specs),
        names=tuple(s.name for s in specs),
        offsets=tuple(offsets),
        order=order,
        method=method,
    )


def _lcm_of_blocks(specs: Sequence[TensorSpec], align: int) -> int:
    return math.lcm(align, *(s.block for s in specs if s.numel > 0))


def naive_plan(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> Plan:
    """Model-order concatenation, starts rounded to each block, S a multiple of all blocks."""
    world_size, align = check_inputs(specs, world_size, align)
    step = _lcm_of_blocks(specs, align) if world_size > 1 else align
    offsets, end = _aligned_concat(specs, [s.block if world_size > 1 else 1 for s in specs])
    return _finish(specs, world_size, align, step=step, offsets=offsets, end=end, method="naive")


def megatron_plan(specs: Sequence[TensorSpec], world_size: int, align: int = 1) -> Plan:
    """Every tensor and the shard size on multiples of the chunk ``lcm(align, all blocks)``."""
    world_size, align = check_inputs(specs, world_size, align)
    chunk = _lcm_of_blocks(specs, align)
    offsets, end = _aligned_concat(specs, [chunk] * len(specs))
    return _finish(
        specs, world_size, align, step=chunk, offsets=offsets, end=end, method="megatron"
    )


@attrs.frozen
class Fsdp2Layout:
    """FSDP2's per-parameter dim-0 split: figures comparable with a ``Plan``.

    ``shard_numel`` is what each rank stores (padded), ``cuts_blocks`` lists the tensors whose
    ``ceil(dim0/m)``-row chunks are not whole blocks (a block-wise optimizer state would need a
    redistribution for them).
    """

    world_size: int
    shard_numel: int
    total_numel: int
    cuts_blocks: tuple[int, ...]

    @property
    def buffer_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def padding(self) -> int:
        return self.buffer_numel - self.total_numel

    @property
    def padding_ratio(self) -> float:
        return self.padding / self.total_numel if self.total_numel else 0.0


def fsdp2_layout(
    shapes: Sequence[Sequence[int]], blocks: Sequence[int], world_size: int
) -> Fsdp2Layout:
    """Per-rank storage of FSDP2's even dim-0 split of tensors of the given shapes.

    A rank stores ``ceil(dim0 / m)`` rows of ``prod(shape[1:])`` elements of every tensor (the
    last ranks' shards are padded up to that), so the padded buffer is ``m`` times the sum.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if len(shapes) != len(blocks):
        raise ValueError(f"{len(shapes)} shapes but {len(blocks)} blocks")
    shard, total, cuts = 0, 0, []
    for index, (shape, block) in enumerate(zip(shapes, blocks, strict=True)):
        dims = tuple(shape) if len(shape) else (1,)
        row = math.prod(dims[1:])
        numel = dims[0] * row
        rows = -(-dims[0] // world_size)
        shard += rows * row
        total += numel
        chunk = rows * row
        if numel and world_size > 1 and chunk < numel and chunk % block != 0:
            cuts.append(index)
    return Fsdp2Layout(
        world_size=world_size, shard_numel=shard, total_numel=total, cuts_blocks=tuple(cuts)
    )
