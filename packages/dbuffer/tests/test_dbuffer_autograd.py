"""Autograd through the full views: saved views survive release/re-allocation, gradients land in
the grad buffer in place, accumulation over two backward passes (threaded process group).

Numerics: same arithmetic, compared bitwise. The references compute each rank's gradients in
one process with the same kernels, then combine them as the threaded process group and the
buffer do: autograd accumulates a rank's micro-batches, the ranks are summed in rank order, and
the sum is scaled by ``1 / world`` (``mul_``, or ``add_(alpha=...)`` when accumulating).
"""

from __future__ import annotations

import pytest
import torch
from dbuffer_helpers import make_tensors
from dbuffer_mlp import MLP_BLOCKS, MLP_SHAPES, mlp_batch, mlp_loss, rank_sum, train_step
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import attach_grads, load_full_, sharded_views
from ragged_dtensor.testing import run_threaded


@pytest.mark.numerics
@pytest.mark.parametrize("mode", ["accumulate-unsharded", "reduce-each-backward"])
@pytest.mark.parametrize("world", [2, 4])
def test_gradients_accumulate_over_two_backward_passes(world: int, mode: str) -> None:
    run_threaded(train_step, world, mode)


def _released_views_are_guarded(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    buf = DBuffer(contiguous_layout([6], world), [(2, 3)], mesh)
    with pytest.raises(RuntimeError, match="unsharded storage is released"):
        buf.full_views()
    with pytest.raises(RuntimeError, match="unsharded storage is released"):
        buf.full_views(torch.bfloat16)
    assert buf.full_views(allow_released=True)[0].shape == (2, 3)


def test_released_views_are_guarded() -> None:
    run_threaded(_released_views_are_guarded, 2)


def _mixed_precision_step(rank: int, world: int) -> None:
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) with DBuffers: bf16
    compute on a gathered cast, bf16 gradients in place, fp32 reduction into fp32 shards."""
    mesh = init_device_mesh("cpu", (world,))
    layout = contiguous_layout(
        [torch.Size(s).numel() for s in MLP_SHAPES], world, blocks=MLP_BLOCKS
    )
    params = load_full_(DBuffer(layout, MLP_SHAPES, mesh), make_tensors(MLP_SHAPES, 0))
    low_grads = params.new_like(torch.bfloat16)
    grads = params.new_like()
    leaves = [
        v.detach().requires_grad_() for v in params.full_views(torch.bfloat16, allow_released=True)
    ]
    params.unshard(dtype=torch.bfloat16)
    loss = mlp_loss(leaves, mlp_batch(rank, 0).to(torch.bfloat16))
    params.reshard()  # the bf16 storage autograd saved is released...
    assert not params.is_unsharded(torch.bfloat16)
    params.unshard(dtype=torch.bfloat16)  # ...and refilled before backward
    low_grads.alloc_unsharded(zero=True)
    attach_grads(low_grads, leaves)
    loss.backward()
    params.reshard()
    low_grads.reduce_scatter(op="avg", reduce_dtype=torch.float32, into=grads)
    assert not low_grads.is_unsharded()
    # Reference: the same bf16 arithmetic in one process, cast to fp32, summed in rank order
    # and scaled by 1 / world (same arithmetic: bitwise).
    per_rank = []
    for r in range(world):
        ref = [p.to(torch.bfloat16).requires_grad_() for p in make_tensors(MLP_SHAPES, 0)]
        mlp_loss(ref, mlp_batch(r, 0).to(torch.bfloat16)).backward()
        per_rank.append([p.grad.float() for p in ref])  # type: ignore[union-attr]
    expected = [t.mul_(1.0 / world) for t in rank_sum(per_rank)]
    for dt, slot, ref_grad in zip(sharded_views(grads), grads.slots, expected, strict=True):
        assert dt.dtype == torch.float32
        rng = slot.placement.flat_range(slot.shape, grads.rank)
        assert torch.equal(dt.to_local(), ref_grad.reshape(-1)[rng.start : rng.stop]), slot.name


@pytest.mark.numerics
def test_mixed_precision_step_matches_the_reference() -> None:
    run_threaded(_mixed_precision_step, 2)
