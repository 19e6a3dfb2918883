import torch
from torch.distributed.tensor import DTensor, Partial, Shard, init_device_mesh

from ragged_dtensor import RaggedShard, distribute_tensor, local_box
from ragged_dtensor.testing import run_processes


def demo(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))  # "cuda" on GPUs: nothing else changes
    full = torch.arange(32 * 4, dtype=torch.float32).reshape(32, 4)
    # 8 units of 4 rows: rank 0 holds 3 units (rows 0-11), rank 1 holds 5 units (rows 12-31);
    # ragged_dtensor's distribute_tensor (torch's, also for RaggedShard)
    w = distribute_tensor(full, mesh, [RaggedShard(dims=(0,), local_units=(3, 5))])
    (rows, _), (first, _) = local_box(w)  # the share as a box: shape and offset
    flat = w.to_local().numel()
    print(f"rank {rank}: rows {first}-{first + rows - 1} of (32, 4), a flat local tensor of {flat}")

    assert torch.equal(w.full_tensor(), full)  # one all-gather
    y = (w * 2 + 1).sqrt_().square_()  # elementwise: stays ragged
    assert y.placements == w.placements
    assert torch.allclose(y.full_tensor(), full * 2 + 1)
    assert torch.equal(w.redistribute(mesh, [Shard(0)]).full_tensor(), full)  # one all-to-all

    g = DTensor.from_local(torch.ones(32, 4), mesh, [Partial()])
    g_ragged = g.redistribute(mesh, w.placements)  # one reduce-scatter
    assert torch.equal(g_ragged.full_tensor(), torch.full((32, 4), float(world)))

    w = torch.nn.Parameter(w)
    w.grad = g_ragged
    torch.nn.utils.clip_grad_norm_([w], 1.0)  # torch's own, unchanged
    torch.optim.AdamW([w], lr=0.1).step()  # foreach/fused work too
    assert w.placements == (RaggedShard((0,), (3, 5)),)


if __name__ == "__main__":
    run_processes(demo, 2)
    print("ok")
