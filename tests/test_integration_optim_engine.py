"""optim_blockwise on fsdp_engine: 8-bit AdamW and Muon on fully_shard equal one process.

The engine lays every shard out on whole quantization blocks (the optimizer's block policy), so
AdamW8bit quantizes its shard with no communication and its states and parameters are
bit-identical to the single-process AdamW8bit; Muon orthogonalizes each matrix once on one root.

Numerics: same arithmetic (every rank sees the whole batch, so each rank's gradient is the
single-process one; 2 or 4 equal gradients sum exactly in any order — for 4, the one rounding,
at 3g, is below half an ulp of 4g — and scaling by 1/2 or 1/4 is exact; one intra-op thread on
both sides): compared bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from optim_engine_model import LOCK, Net, init_state
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

import optim_blockwise as ob
from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_processes, run_threaded

pytestmark = pytest.mark.numerics

STEPS = 5


def _data(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2 * world, 17), generator=gen) for _ in range(STEPS)]


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw8bit":
        return ob.AdamW8bit(model.parameters(), lr=1e-2, weight_decay=0.1, block_size=256)
    matrices = [p for n, p in model.named_parameters() if p.dim() == 2 and "blocks" in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "blocks" in n)]
    return ob.Muon(
        [{"params": matrices}, {"params": rest, "use_muon": False}], lr=2e-2, ns_dtype=torch.float32
    )


def _single(kind: str, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)  # the ranks run with one intra-op thread too
    with LOCK:
        model = Net()
    model.load_state_dict(init_state())
    opt = _optimizer(kind, model)
    for tokens in _data(world):
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded(rank: int, world: int, kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    with LOCK:
        model = Net()
    model.load_state_dict(init_state())
    policy = (
        ob.AdamW8bit.block_policy(block_size=256)
        if kind == "adamw8bit"
        else (ob.Muon.block_policy())
    )
    for block in model.blocks:
        fully_shard(block, mesh=mesh, block_policy=policy)
    fully_shard(model, mesh=mesh, block_policy=policy)
    opt = _optimizer(kind, model)
    for tokens in _data(world):
        # every rank sees the whole batch: the averaged gradient is then bitwise the
        # single-process gradient, so any difference would be the optimizer's or the layout's
        _loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }


# world sizes whose gradient average of identical per-rank gradients is exact in fp32
# ((g + g) / 2 == g); at 3 ranks (g + g + g) / 3 can differ by an ulp, which 8-bit states amplify.
@pytest.mark.parametrize("world", [2])
def test_adamw8bit_on_fully_shard_equals_one_process(world: int) -> None:
    want = _single("adamw8bit", world)
    for got in run_threaded(_sharded, world, "adamw8bit", timeout=180):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


@pytest.mark.parametrize("world", [2])
def test_muon_on_fully_shard_equals_one_process(world: int) -> None:
    want = _single("muon", world)
    for got in run_threaded(_sharded, world, "muon", timeout=180):
        for key, value in want.items():
            assert torch.equal(got[key], value), key


def _gloo(rank: int, world: int) -> dict[str, Any]:
    return _sharded(rank, world, "adamw8bit")


@pytest.mark.slow  # CI budget; the threaded test and optim-blockwise's gloo test stay in CI
@pytest.mark.multiprocess
def test_adamw8bit_on_fully_shard_on_gloo_4_ranks() -> None:
    want = _single("adamw8bit", 4)
    for got in run_processes(_gloo, 4, timeout=300, threads=1):
        for key, value in want.items():
            assert torch.equal(got[key], value), key
