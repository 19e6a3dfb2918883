"""A two-layer MLP trained through a ``DBuffer``'s full views, and its single-process
reference gradients (shared by dbuffer's autograd and gloo tests).

Numerics: same arithmetic. The references compute each rank's gradients in one process with the
same kernels, then combine them as the threaded process group and the buffer do: autograd
accumulates a rank's micro-batches, the ranks are summed in rank order, and the sum is scaled by
``1 / world`` (``mul_``, or ``add_(alpha=...)`` when accumulating).
"""

from __future__ import annotations

import torch
from dbuffer_helpers import make_tensors
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import attach_grads, load_full_, sharded_views

# A two-layer MLP with row blocks, so shard boundaries fall between rows.
MLP_SHAPES = [(32, 16), (32,), (8, 32), (8,)]
MLP_BLOCKS = [16, 1, 32, 1]


def mlp_loss(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return torch.tanh(x @ w1.T + b1).matmul(w2.T).add(b2).pow(2).mean()


def mlp_batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(1000 * rank + micro))


def rank_grads(rank: int, micros: range) -> list[torch.Tensor]:
    """One rank's gradient, accumulated by autograd over its micro-batches."""
    params = [p.clone().requires_grad_() for p in make_tensors(MLP_SHAPES, 0)]
    for micro in micros:
        mlp_loss(params, mlp_batch(rank, micro)).backward()
    return [p.grad for p in params]  # type: ignore[misc]


def rank_sum(per_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The threaded process group's reduction: rank 0's tensor, then each rank's added."""
    total = [g.clone() for g in per_rank[0]]
    for grads in per_rank[1:]:
        for acc, g in zip(total, grads, strict=True):
            acc.add_(g)
    return total


def reference_grads(world: int, mode: str) -> list[torch.Tensor]:
    if mode == "accumulate-unsharded":  # one reduction of the accumulated gradients
        total = rank_sum([rank_grads(r, range(2)) for r in range(world)])
        return [t.mul_(1.0 / world) for t in total]
    out = [torch.zeros(s) for s in MLP_SHAPES]  # one accumulating reduction per micro-batch
    for micro in range(2):
        summed = rank_sum([rank_grads(r, range(micro, micro + 1)) for r in range(world)])
        for acc, t in zip(out, summed, strict=True):
            acc.add_(t, alpha=1.0 / world)
    return out


def grad_magnitude(world: int) -> list[torch.Tensor]:
    """sum over ranks and micro-batches of |gradient|: the scale of the reduction's rounding."""
    total = [torch.zeros(s) for s in MLP_SHAPES]
    for r in range(world):
        for micro in range(2):
            for acc, g in zip(total, rank_grads(r, range(micro, micro + 1)), strict=True):
                acc.add_(g.abs())
    return [t / world for t in total]


def train_step(rank: int, world: int, mode: str, *, exact: bool = True) -> None:
    """``exact=False`` where the process group sums in an order the reference cannot mirror
    (gloo at 4 ranks): different arithmetic, bounded as in ``dbuffer_reference.Expected``:
    (n + 3) * eps * (sum |g|) / world for n = world * 2 summed terms."""
    mesh = init_device_mesh("cpu", (world,))
    layout = contiguous_layout(
        [torch.Size(s).numel() for s in MLP_SHAPES], world, blocks=MLP_BLOCKS
    )
    params = load_full_(DBuffer(layout, MLP_SHAPES, mesh), make_tensors(MLP_SHAPES, 0))
    grads = params.new_like()
    storage = params.unsharded.untyped_storage()
    # Leaves made once: aliases of the unsharded storage (they never own memory).
    leaves = [v.detach().requires_grad_() for v in params.full_views(allow_released=True)]
    for step in range(2):  # the same views serve every step
        grads.zero_()
        if mode == "accumulate-unsharded":
            # no_sync-style: gradients of both micro-batches accumulate into the unsharded
            # grad storage, one reduce-scatter at the end.
            grads.alloc_unsharded(zero=True)
            attach_grads(grads, leaves)
        for micro in range(2):
            params.unshard()
            loss = mlp_loss(leaves, mlp_batch(rank, micro))
            params.reshard()  # forward done: free; autograd holds views of the freed storage
            assert storage.nbytes() == 0 and not params.is_unsharded()
            params.unshard()  # the backward pre-hook's gather refills the same storage
            if mode == "reduce-each-backward":
                grads.alloc_unsharded(zero=True)
                attach_grads(grads, leaves)
            grad_storage = grads.unsharded.untyped_storage()
            loss.backward()
            # Autograd wrote into the views: still the grad buffer's storage, no new tensor.
            for leaf, view in zip(leaves, grads.full_views(), strict=True):
                assert leaf.grad is view
                assert leaf.grad.untyped_storage().data_ptr() == grad_storage.data_ptr()
            params.reshard()
            if mode == "reduce-each-backward":
                grads.reduce_scatter(op="avg", accumulate=True)
                assert all(leaf.grad is None for leaf in leaves)  # detached on release
        if mode == "accumulate-unsharded":
            grads.reduce_scatter(op="avg")
        expected = reference_grads(world, mode)
        scale = grad_magnitude(world) if not exact else expected
        bound_factor = (2 * world + 3) * torch.finfo(torch.float32).eps
        for dt, slot, ref, mag in zip(
            sharded_views(grads), grads.slots, expected, scale, strict=True
        ):
            rng = slot.placement.flat_range(slot.shape, grads.rank)
            want = ref.reshape(-1)[rng.start : rng.stop]
            if exact:
                assert torch.equal(dt.to_local(), want), slot.name
            else:
                bound = bound_factor * mag.reshape(-1)[rng.start : rng.stop]
                assert bool(((dt.to_local() - want).abs() <= bound).all()), slot.name
        del step
