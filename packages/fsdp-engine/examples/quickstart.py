import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_processes


def train(rank: int, world: int) -> float:
    torch.manual_seed(0)  # same initial weights on every rank
    model = nn.Sequential(
        nn.Embedding(101, 32),
        *[nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2)],
        nn.Linear(32, 101),
    )
    mesh = init_device_mesh("cpu", (world,))  # "cuda" with NCCL: nothing else changes
    for block in model[1:3]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(5):
        tokens = torch.randint(0, 101, (4, 16), generator=gen)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    return loss.item()


if __name__ == "__main__":
    print(run_processes(train, 2))
    print("ok")
