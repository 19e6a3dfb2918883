import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import optim_blockwise as ob
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded


def train(rank: int, world: int) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    placement = RaggedShard((0,), (3, 5))  # rank 0: rows 0-23, rank 1: rows 24-63
    r = placement.flat_range(full.shape, rank)
    local = full.reshape(-1)[r.start : r.stop].clone()
    weight = torch.nn.Parameter(
        DTensor.from_local(
            local, mesh, [placement], shape=full.shape, stride=full.stride(), run_check=False
        )
    )
    opt = ob.Muon([weight], lr=0.02)
    for step in range(3):
        g = torch.randn(64, 96, generator=torch.Generator().manual_seed(step))
        weight.grad = DTensor.from_local(
            g.reshape(-1)[r.start : r.stop].clone(),
            mesh,
            [placement],
            shape=g.shape,
            stride=g.stride(),
            run_check=False,
        )
        opt.step()  # all-to-all to the owner, Newton-Schulz once, all-to-all back
    return weight.to_local()


shards = run_threaded(train, 2)
print(torch.cat(shards).shape)  # torch.Size([6144]): the whole 64x96 matrix, updated
