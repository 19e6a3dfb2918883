"""fully_shard on the "dp" axis composes with tensor parallelism on the "tp" axis.

Numerics: different arithmetic (tensor parallelism splits the row-wise matmul's inner sum across
ranks; the reference takes the whole batch): float64 within ``FP64_TOLERANCE``.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_training import FP64_TOLERANCE
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from fsdp_engine import fully_shard
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded

# threads share torch's global generator: every construction holds this lock
_LOCK = threading.RLock()
STEPS = 5


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 40)
        self.down = nn.Linear(40, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


def _init() -> dict[str, torch.Tensor]:
    with _LOCK, torch.random.fork_rng():  # threads share torch's global generator
        torch.manual_seed(0)
        return {k: v.double() for k, v in MLP().state_dict().items()}


def _data() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(4, 12, generator=gen, dtype=torch.float64) for _ in range(STEPS)]


def _reference() -> dict[str, torch.Tensor]:
    model = MLP().double()
    model.load_state_dict(_init())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x in _data():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _train(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    with _LOCK:
        model = MLP().double()
    model.load_state_dict(_init())
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    fully_shard(model, mesh=mesh["dp"])
    weight = model.up.weight
    assert isinstance(weight, DTensor)
    assert isinstance(weight.placements[0], RaggedShard) and weight.placements[1] == Shard(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh.get_local_rank("dp")
    for x in _data():
        model(x.chunk(2)[dp]).square().mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)  # exercises 2-D norms
        opt.step()
        opt.zero_grad()
    return {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.numerics
def test_fsdp_on_dp_composes_with_tp_shard() -> None:
    want = _reference()
    for got in run_threaded(_train, 4, timeout=120):
        for key, value in want.items():
            scale = value.abs().max().item()  # relative to the tensor's largest entry
            torch.testing.assert_close(got[key], value, rtol=0.0, atol=FP64_TOLERANCE * scale)
