"""All-gather / reduce-scatter against a single-process reference (threaded process group).

Numerics: gathers move bits (compared bitwise); reductions are different arithmetic, checked
against the float64 sum with the bound derived in ``dbuffer_reference.Expected``.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist
from dbuffer_helpers import (
    BLOCKS,
    SHAPES,
    collective_counts,
    install_collective_counter,
    make_tensors,
    reset_collective_counts,
)
from dbuffer_reference import check_shards, reference
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import CopiedBytes, load_full_
from ragged_dtensor.testing import run_threaded

install_collective_counter()
pytestmark = pytest.mark.numerics


def _layout(world: int) -> object:
    return contiguous_layout([torch.Size(s).numel() for s in SHAPES], world, blocks=BLOCKS)


def _gather_reduce(
    rank: int,
    world: int,
    op: str,
    reduce_dtype: torch.dtype | None,
    accumulate: bool,
    async_op: bool,
) -> None:
    mesh = init_device_mesh("cpu", (world,))
    params = make_tensors(SHAPES, 0)
    buf = load_full_(DBuffer(_layout(world), SHAPES, mesh), params)  # type: ignore[arg-type]
    reset_collective_counts()
    handle = buf.unshard(async_op=async_op)
    handle.wait()
    assert handle.done
    assert collective_counts() == Counter(all_gather_single=1)
    for view, param in zip(buf.full_views(), params, strict=True):
        assert torch.equal(view, param)  # a gather moves bits: exact
    buf.reshard()

    grads = buf.new_like()
    initial = make_tensors(SHAPES, 7)
    if accumulate:
        load_full_(grads, initial)
    for view, g in zip(
        grads.alloc_unsharded(zero=True), make_tensors(SHAPES, 100 + rank), strict=True
    ):
        view.copy_(g)  # what autograd does through .grad views (see test_dbuffer_autograd)
    reset_collective_counts()
    handle = grads.reduce_scatter(
        op=op,
        reduce_dtype=reduce_dtype,  # type: ignore[arg-type]
        accumulate=accumulate,
        async_op=async_op,
    )
    handle.wait()
    assert collective_counts() == Counter(reduce_scatter_single=1)
    assert not grads.is_unsharded()  # the input storage is released when the handle completes
    expected = reference(range(world), op, reduce_dtype)
    if accumulate:
        expected = expected.plus(initial)
    check_shards(grads, expected)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_gather_and_reduce_match_the_reference(world: int, op: str) -> None:
    run_threaded(_gather_reduce, world, op, None, False, False)


@pytest.mark.parametrize(
    ("reduce_dtype", "accumulate", "async_op"),
    [
        (None, True, False),
        (None, False, True),
        (torch.bfloat16, False, False),
        (torch.bfloat16, True, True),
        (torch.float64, False, False),
    ],
)
def test_reduce_variants_match_the_reference(
    reduce_dtype: torch.dtype | None, accumulate: bool, async_op: bool
) -> None:
    run_threaded(_gather_reduce, 2, "avg", reduce_dtype, accumulate, async_op)


def _hsdp(rank: int, world: int, async_op: bool) -> None:
    mesh = init_device_mesh("cpu", (2, 2))  # axis 0 replicate, axis 1 shard
    params = make_tensors(SHAPES, 0)
    buf = load_full_(DBuffer(_layout(2), SHAPES, mesh), params)  # type: ignore[arg-type]
    assert buf.rank == mesh.get_local_rank(1) and buf.replicate_axes == (0,)
    reset_collective_counts()
    buf.unshard(async_op=async_op).wait()
    assert collective_counts() == Counter(all_gather_single=1)
    assert all(torch.equal(v, p) for v, p in zip(buf.full_views(), params, strict=True))
    grads = buf.new_like()
    for view, g in zip(grads.alloc_unsharded(), make_tensors(SHAPES, 100 + rank), strict=True):
        view.copy_(g)
    reset_collective_counts()
    grads.reduce_scatter(op="avg", async_op=async_op).wait()
    # One reduce-scatter over the shard axis, one all-reduce over the replicate axis.
    assert collective_counts() == Counter(reduce_scatter_single=1, all_reduce=1)
    check_shards(grads, reference(range(4), "avg", None))


@pytest.mark.parametrize("async_op", [False, True])
def test_hsdp_reduce_scatter_then_all_reduce(async_op: bool) -> None:
    run_threaded(_hsdp, 4, async_op)


def _backend_copies(fn: object) -> int:
    """Bytes the process group's own implementation copies (the threaded PG copies in Python,
    gloo copies the reduce-scatter result in C++ code that reaches the dispatcher)."""
    with CopiedBytes() as copied:
        fn()  # type: ignore[operator]
    return copied.total


def _mixed_precision(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    params = make_tensors(SHAPES, 0)
    buf = load_full_(DBuffer(_layout(world), SHAPES, mesh), params)  # type: ignore[arg-type]
    size = buf.shard_size

    def bare_gather(dtype: torch.dtype) -> None:
        out = torch.empty(size * world, dtype=dtype)
        dist.all_gather_single(out, torch.zeros(size, dtype=dtype), group=group)

    def bare_reduce() -> None:
        dist.reduce_scatter_single(torch.empty(size), torch.zeros(size * world), group=group)

    reset_collective_counts()
    with CopiedBytes() as copied:
        buf.unshard(dtype=torch.bfloat16)
    assert collective_counts() == Counter(all_gather_single=1)
    # The shard is cast once (S bf16 elements written); nothing else beyond the backend's own.
    assert copied.total == size * 2 + _backend_copies(lambda: bare_gather(torch.bfloat16))
    assert buf.is_unsharded(torch.bfloat16) and not buf.is_unsharded()
    for view, param in zip(buf.full_views(torch.bfloat16), params, strict=True):
        assert view.dtype == torch.bfloat16
        assert torch.equal(view, param.to(torch.bfloat16))
    buf.reshard()
    assert not buf.is_unsharded(torch.bfloat16)
    # The fp32 path adds no copy at all to the collective's own.
    with CopiedBytes() as copied:
        buf.unshard()
    assert copied.total == _backend_copies(lambda: bare_gather(torch.float32)), copied.by_op
    grads = buf.new_like()
    grads.alloc_unsharded(zero=True)
    with CopiedBytes() as copied:
        grads.reduce_scatter(op="sum")
    assert copied.total == _backend_copies(bare_reduce), copied.by_op


def test_mixed_precision_unshard_casts_the_shard_once() -> None:
    run_threaded(_mixed_precision, 2)


def _inflight(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    params = make_tensors(SHAPES, 0)
    buf = load_full_(DBuffer(_layout(world), SHAPES, mesh), params)  # type: ignore[arg-type]
    handle = buf.unshard(async_op=True)
    buf.reshard()  # waits for the gather first: memory is never freed under a collective
    assert handle.done and not buf.is_unsharded()
    grads = buf.new_like()
    for view, g in zip(grads.alloc_unsharded(), make_tensors(SHAPES, 100 + rank), strict=True):
        view.copy_(g)
    handle = grads.reduce_scatter(op="sum", async_op=True)
    grads.scale_(1.0 / world)  # a fused op waits for the reduce-scatter writing the shard
    assert handle.done
    check_shards(grads, reference(range(world), "avg", None))


def test_ops_wait_for_collectives_in_flight() -> None:
    run_threaded(_inflight, 2)


def _fp16_mean(rank: int, world: int, value: float) -> list[float]:
    mesh = init_device_mesh("cpu", (world,))
    layout = contiguous_layout([8], world)
    grads = DBuffer(layout, [(8,)], mesh, dtype=torch.float16)
    grads.alloc_unsharded()[0].fill_(value)
    grads.reduce_scatter(op="avg").wait()
    return [float(x) for x in grads.shard]


@pytest.mark.parametrize("world", [2, 4])
def test_fp16_mean_neither_overflows_nor_rounds_differently_from_fsdp2(world: int) -> None:
    """[Note: dividing a mean of gradients]: fp16 gradients of 30000 on every rank sum to more
    than fp16's largest finite value (65504) at 4 ranks; dividing each by p = 2 first (FSDP2's
    factor for 2 and 4 ranks), summing, then dividing by world / p gives the mean exactly
    (every step is exact in fp16 here), where summing first gives inf. Same arithmetic as the
    reference: exact equality."""
    for shard in run_threaded(_fp16_mean, world, 30000.0):
        assert shard == [30000.0] * len(shard), shard
