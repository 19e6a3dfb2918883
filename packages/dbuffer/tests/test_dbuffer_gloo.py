"""What crosses processes: real gloo process groups at world sizes 2 and 4 (and a 2 x 2 mesh).

Collectives are counted at the dispatcher (``c10d.*`` ops), independently of dbuffer's own calls.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from dbuffer_helpers import BLOCKS, SHAPES, DispatchedOps, make_tensors
from dbuffer_mlp import train_step
from dbuffer_reference import check_shards, reference
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, LayoutMismatchError, contiguous_layout
from dbuffer.testing import CopiedBytes, load_full_
from ragged_dtensor.testing import run_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.numerics]


def _layout(world: int) -> object:
    return contiguous_layout([torch.Size(s).numel() for s in SHAPES], world, blocks=BLOCKS)


def _gather_reduce(mesh_shape: tuple[int, ...]) -> dict[str, int]:
    mesh = init_device_mesh("cpu", mesh_shape)
    world = mesh_shape[-1]
    params = make_tensors(SHAPES, 0)
    buf = load_full_(DBuffer(_layout(world), SHAPES, mesh), params)  # type: ignore[arg-type]
    with DispatchedOps() as ops, CopiedBytes() as gather_copies:
        buf.unshard()
    assert Counter(ops.collectives()) == Counter({"c10d._allgather_base_.default": 1})
    assert gather_copies.total == 0, gather_copies.by_op  # no copy-in, no copy-out
    assert all(torch.equal(v, p) for v, p in zip(buf.full_views(), params, strict=True))
    buf.reshard()
    grads = buf.new_like()
    for view, g in zip(
        grads.alloc_unsharded(), make_tensors(SHAPES, 100 + dist.get_rank()), strict=True
    ):
        view.copy_(g)
    with DispatchedOps() as ops, CopiedBytes() as reduce_copies:
        grads.reduce_scatter(op="avg")
    expected = {"c10d._reduce_scatter_base_.default": 1}
    if len(mesh_shape) == 2:
        expected["c10d.allreduce_.default"] = 1
    assert Counter(ops.collectives()) == Counter(expected)
    check_shards(grads, reference(range(dist.get_world_size()), "avg", None))
    # gloo's reduce-scatter copies its result out of an internal all-reduce buffer (backend
    # code, reached through the dispatcher): the same bytes as a bare reduce-scatter.
    bare = torch.empty(buf.shard_size)
    with CopiedBytes() as backend:
        dist.reduce_scatter_single(
            bare, torch.zeros(world * buf.shard_size), group=mesh.get_group(mesh.ndim - 1)
        )
    assert reduce_copies.total == backend.total, (reduce_copies.by_op, backend.by_op)
    return {"reduce_copies": reduce_copies.total, "backend": backend.total}


def _async_and_mixed_precision(mesh_shape: tuple[int, ...]) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    world = mesh_shape[-1]
    params = make_tensors(SHAPES, 0)
    buf = load_full_(DBuffer(_layout(world), SHAPES, mesh), params)  # type: ignore[arg-type]
    # Mixed precision: one cast of the shard (S bf16 elements), one bf16 all-gather, async.
    with DispatchedOps() as ops, CopiedBytes() as copied:
        handle = buf.unshard(dtype=torch.bfloat16, async_op=True)
        handle.wait()
    assert ops.collectives() == ["c10d._allgather_base_.default"]
    assert copied.total == buf.shard_size * 2, copied.by_op
    for view, param in zip(buf.full_views(torch.bfloat16), params, strict=True):
        assert torch.equal(view, param.to(torch.bfloat16))
    buf.reshard()
    # Async reduce-scatter with a bf16 reduce dtype, accumulated into an fp32 sharded gradient.
    grads = buf.new_like()
    initial = make_tensors(SHAPES, 7)
    load_full_(grads, initial)
    for view, g in zip(
        grads.alloc_unsharded(), make_tensors(SHAPES, 100 + dist.get_rank()), strict=True
    ):
        view.copy_(g)
    handle = grads.reduce_scatter(
        op="avg", reduce_dtype=torch.bfloat16, accumulate=True, async_op=True
    )
    handle.wait()
    expected = reference(range(dist.get_world_size()), "avg", torch.bfloat16).plus(initial)
    check_shards(grads, expected)
    assert not grads.is_unsharded()
    # An async gloo all-gather bumps its output's version counter in the background when it
    # completes; views autograd saved must still see the version they were saved at.
    view = buf.full_views(allow_released=True)[0]
    saved = view._version
    handle = buf.unshard(async_op=True)
    time.sleep(0.2)  # let the background completion happen before the wait
    handle.wait()
    assert view._version == saved, (view._version, saved)
    buf.reshard()


def _world_2(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    # A layout mismatch raises on every rank instead of aborting gloo in a later collective.
    layout = contiguous_layout([10, 6], world, align=4 if rank == 1 else 1)
    with pytest.raises(LayoutMismatchError, match="layout fingerprint: ranks \\[0\\] have"):
        DBuffer(layout, [(10,), (6,)], mesh)
    _gather_reduce((world,))
    _async_and_mixed_precision((world,))
    for mode in ("accumulate-unsharded", "reduce-each-backward"):
        train_step(rank, world, mode)
    dist.barrier()


# CI budget: in `nox -s slow`; test_gloo_world_4_and_hsdp_2x2 runs the same paths in CI
@pytest.mark.slow
def test_gloo_world_2() -> None:
    run_processes(_world_2, 2, timeout=180)


def _world_4(rank: int, world: int) -> None:
    _gather_reduce((world,))
    _gather_reduce((2, 2))  # HSDP: axis 0 replicate, axis 1 shard
    _async_and_mixed_precision((2, 2))
    train_step(rank, world, "accumulate-unsharded", exact=False)  # gloo's own sum order
    dist.barrier()


def test_gloo_world_4_and_hsdp_2x2() -> None:
    run_processes(_world_4, 4, timeout=240)
