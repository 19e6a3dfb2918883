"""Property test: random groups, blocks, alignments and world sizes; gather and reduce-scatter
equal the single-process reference and every view is zero-copy (threaded process group)."""

from __future__ import annotations

import math
import os

import torch
from dbuffer_helpers import make_tensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import load_full_, sharded_views
from ragged_dtensor.testing import run_threaded

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[tuple[int, ...]], list[int], int, int]:
    shapes: list[tuple[int, ...]] = []
    blocks: list[int] = []
    for _ in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=3)))
        numel = math.prod(shape)
        # A block is a divisor of the numel: a number of rows, or single elements.
        divisors = [d for d in range(1, numel + 1) if numel % d == 0] or [1]
        shapes.append(shape)
        blocks.append(draw(st.sampled_from(divisors)))
    return shapes, blocks, draw(st.integers(1, 4)), draw(st.sampled_from([1, 2, 4]))


def _roundtrip(
    rank: int, world: int, shapes: list[tuple[int, ...]], blocks: list[int], align: int
) -> None:
    mesh = init_device_mesh("cpu", (world,))
    layout = contiguous_layout([math.prod(s) for s in shapes], world, blocks=blocks, align=align)
    full = make_tensors(shapes, 0)
    buf = load_full_(DBuffer(layout, shapes, mesh), full)
    ptr = buf.shard.untyped_storage().data_ptr()
    for dt, slot, tensor in zip(sharded_views(buf), buf.slots, full, strict=True):
        assert dt._local_tensor.untyped_storage().data_ptr() == ptr
        rng = slot.placement.flat_range(slot.shape, rank)
        assert torch.equal(dt.to_local(), tensor.reshape(-1)[rng.start : rng.stop])
    buf.unshard()
    assert all(torch.equal(v, t) for v, t in zip(buf.full_views(), full, strict=True))
    buf.reshard()
    grads = buf.new_like()
    for view, g in zip(grads.alloc_unsharded(), make_tensors(shapes, 100 + rank), strict=True):
        view.copy_(g)
    grads.reduce_scatter(op="sum")
    # Same arithmetic: the threaded process group sums in rank order in fp32 (bitwise).
    for dt, slot in zip(sharded_views(grads), grads.slots, strict=True):
        ref = make_tensors(shapes, 100)[slot.index].clone()
        for r in range(1, world):
            ref += make_tensors(shapes, 100 + r)[slot.index]
        rng = slot.placement.flat_range(slot.shape, rank)
        assert torch.equal(dt.to_local(), ref.reshape(-1)[rng.start : rng.stop]), slot.name


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_property_roundtrip_matches_reference(
    case: tuple[list[tuple[int, ...]], list[int], int, int],
) -> None:
    shapes, blocks, world, align = case
    run_threaded(_roundtrip, world, shapes, blocks, align)
