import torch
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import LiveBytes, attach_grads, load_full_, sharded_views
from ragged_dtensor.testing import run_processes

SHAPES = [(64, 32), (64,), (10, 64), (10,)]  # a two-layer MLP


def loss_fn(params, x):
    w1, b1, w2, b2 = params
    return torch.relu(x @ w1.T + b1).matmul(w2.T).add(b2).logsumexp(-1).mean()


def demo(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))  # "cuda" on GPUs: nothing else changes
    # Any BufferLayout works (shard_planner.plan(...) gives a tighter one); blocks here are rows.
    layout = contiguous_layout([64 * 32, 64, 10 * 64, 10], world, blocks=[32, 1, 64, 1])
    torch.manual_seed(0)
    init = [torch.randn(s) * 0.1 for s in SHAPES]
    params = load_full_(DBuffer(layout, SHAPES, mesh), init)  # ranks compare layouts here
    grads = params.new_like()  # same layout: gradients land in place
    print(f"rank {rank}:", [str(dt.placements[0]) for dt in sharded_views(params)])

    # Leaves made once: aliases of the unsharded storage, valid across free/re-allocation.
    leaves = [v.detach().requires_grad_() for v in params.full_views(allow_released=True)]
    with LiveBytes(seed=[params.shard, grads.shard]) as live:
        for step in range(3):
            params.unshard()  # one all-gather, straight into the views: no copy-out
            grads.alloc_unsharded(zero=True)
            attach_grads(grads, leaves)  # leaf.grad = a view of the grad buffer
            x = torch.randn(8, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            loss = loss_fn(leaves, x)
            params.reshard()  # freed now; autograd's saved views stay valid
            params.unshard()  # re-gather for backward (same storage object)
            loss.backward()  # autograd accumulates into the grad buffer's views
            params.reshard()
            grads.reduce_scatter(op="avg")  # one reduce-scatter, no copy-in; frees the input
            params.add_(grads, alpha=-0.1)  # SGD on the whole shard: one fused kernel
            print(f"rank {rank} step {step}: loss {loss.item():.4f}")
            del loss, x
    shard_bytes = params.nbytes + grads.nbytes
    assert live.current == shard_bytes, live.current  # nothing unsharded is left alive
    print(f"rank {rank}: peak {live.peak} B, shards {shard_bytes} B")


if __name__ == "__main__":
    run_processes(demo, 2)
    print("ok")
