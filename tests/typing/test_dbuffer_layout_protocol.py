"""The planner's ``Plan`` satisfies dbuffer's ``BufferLayout`` structurally (checked by mypy
--strict in ``nox -s typecheck``), and a DBuffer built on a real plan works (pytest).

dbuffer never imports shard_planner; only this cross-package test sees both.
"""

from __future__ import annotations

import attrs
import torch
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import BufferLayout, ContiguousLayout, DBuffer, contiguous_layout
from ragged_dtensor.testing import run_threaded
from shard_planner import Plan, TensorSpec, plan

SHAPES = [(16,), (24, 16), (0, 16), (37, 16), (5,), ()]
BLOCKS = [1, 16, 16, 16, 1, 1]


@attrs.frozen
class _StandIn:
    """The planner's documented names and types, nothing more (frozen, like the planner's)."""

    shard_size: int
    world_size: int
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    blocks: tuple[int, ...]
    fingerprint: str

    def local_units(self, i: int) -> tuple[int, ...]:
        return (1,) if i == 0 else (0,)


def _plan(world: int) -> Plan:
    specs = [
        TensorSpec(numel=torch.Size(s).numel(), block=b, name=f"t{i}")
        for i, (s, b) in enumerate(zip(SHAPES, BLOCKS, strict=True))
    ]
    return plan(specs, world_size=world, align=4)


def test_plan_is_a_buffer_layout() -> None:
    planned: Plan = _plan(2)
    layout: BufferLayout = planned  # the structural check mypy performs
    stand_in: BufferLayout = _StandIn(4, 1, (0,), (4,), (1,), "x")
    naive: BufferLayout = contiguous_layout([4, 6], 2)
    also: BufferLayout = ContiguousLayout(5, 2, (0, 4), (4, 6), (1, 1))
    not_a_layout: BufferLayout = object()  # type: ignore[assignment]  # mypy must reject this
    for value in (layout, stand_in, naive, also):
        assert isinstance(value, BufferLayout)
    assert not isinstance(not_a_layout, BufferLayout)


def _gather_with_plan(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    layout = _plan(world)
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) for s in SHAPES]
    buf = DBuffer(layout, SHAPES, mesh).load_full_(full)
    for i, dt in enumerate(buf.sharded_views()):
        if layout.numels[i]:
            assert dt.placements[0] == buf.slots[i].placement
            assert buf.slots[i].placement.local_units == layout.local_units(i)
    buf.unshard()
    for view, tensor, offset in zip(buf.full_views(), full, layout.offsets, strict=True):
        assert torch.equal(view, tensor)
        if tensor.numel():
            assert view.storage_offset() == offset


def test_dbuffer_runs_on_a_planner_plan() -> None:
    for world in (2, 4):
        run_threaded(_gather_with_plan, world)
