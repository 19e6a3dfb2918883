import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard
from optim_blockwise import FlatAdamW
from ragged_dtensor.testing import run_processes


def train(rank: int, world: int, optimizer: type[torch.optim.Optimizer]) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(64, 32), nn.LayerNorm(32), nn.Linear(32, 64))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    matrices = [p for p in model.parameters() if p.dim() == 2]
    others = [p for p in model.parameters() if p.dim() < 2]  # norms and biases: no decay
    groups = [{"params": matrices, "weight_decay": 0.1}, {"params": others, "weight_decay": 0.0}]
    opt = optimizer(groups, lr=1e-2)
    tokens = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def both(rank: int, world: int) -> bool:
    flat, ref = train(rank, world, FlatAdamW), train(rank, world, torch.optim.AdamW)
    return all(torch.equal(a, b) for a, b in zip(flat, ref, strict=True))


if __name__ == "__main__":
    assert run_processes(both, 2) == [True, True]  # bit-identical to torch's AdamW
    print("ok")
