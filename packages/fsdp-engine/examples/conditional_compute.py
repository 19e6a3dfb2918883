import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_processes


class MoE(nn.Module):
    """Top-1 routing; experts that get no token on this rank are skipped."""

    def __init__(self, dim: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts)
        self.experts = nn.ModuleList(nn.Linear(dim, dim) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        choice = gates.argmax(dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (choice == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(x[idx]) * gates[idx, e : e + 1])
        return x + out


def train(rank: int, world: int) -> list[bool]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), MoE(), nn.Linear(16, 1))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)  # different data: different experts per rank
    for _ in range(3):
        x = torch.randn(3 + rank, 16, generator=gen)
        F.mse_loss(model(x), torch.zeros(len(x), 1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return [p.grad is not None for p in model.parameters()]


if __name__ == "__main__":
    presence = run_processes(train, 2)
    assert presence[0] == presence[1] and all(presence[0])
    print("ok")
