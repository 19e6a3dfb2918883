"""Shampoo and SOAP on fsdp_engine's fully_shard with their block policy.

With ``block_policy=Shampoo.block_policy(d)`` the engine never puts a shard boundary inside a band
of ``d`` rows, so every preconditioner tile lies whole on one rank: the optimizer step runs no
collective at all, and states and parameters equal the single-process optimizer bit for bit
(*same arithmetic*: one thread set explicitly, every rank sees the whole batch so the averaged
gradient is exactly the single-process one, and each tile's math runs on a fresh fp32 copy).
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

STEPS = 4
MAX_DIM = 32  # divides 64, 96 and 160: every matrix's bands divide its rows


def _data(world: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 64, (2 * world, 17), generator=gen) for _ in range(STEPS)]


def _optimizer(kind: str, model: nn.Module) -> Any:
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "max_preconditioner_dim": MAX_DIM}
    kw["precondition_frequency"] = 2
    if kind == "shampoo":
        return ob.Shampoo(model.parameters(), start_preconditioning_step=1, **kw)
    return ob.SOAP(model.parameters(), **kw)


def _train(model: nn.Module, opt: Any, world: int) -> list[dict[str, int]]:
    stats = []
    for tokens in _data(world):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        stats.append(dict(opt.last_step_stats))
    return stats


def _single(kind: str, world: int) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    with LOCK:
        model = Net()
    model.load_state_dict(init_state())
    _train(model, _optimizer(kind, model), world)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _sharded(rank: int, world: int, kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    with LOCK:
        model = Net()
    model.load_state_dict(init_state())
    policy = ob.Shampoo.block_policy(MAX_DIM)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, block_policy=policy)
    fully_shard(model, mesh=mesh, block_policy=policy)
    opt = _optimizer(kind, model)
    stats = _train(model, opt, world)
    params = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return {"params": params, "stats": stats}


def _check(kind: str, world: int, results: list[dict[str, Any]]) -> None:
    want = _single(kind, world)
    tiles = 0
    for got in results:
        for key, value in want.items():
            assert torch.equal(got["params"][key], value), key
        for s in got["stats"]:
            assert s["collectives"] == 0 and s["exchanged_tiles"] == 0, s
        tiles += got["stats"][-1]["local_tiles"]
    # 64x96 -> 2x3, 160x96 -> 5x3, 96x160 -> 3x5 (x2 blocks), 64x96 -> 2x3: each once
    assert tiles == 6 + 2 * (15 + 15) + 6


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_on_fully_shard_with_the_policy_equals_one_process_with_no_exchange(kind: str) -> None:
    _check(kind, 2, run_threaded(_sharded, 2, kind, timeout=180))


def _gloo(rank: int, world: int) -> dict[str, Any]:
    return _sharded(rank, world, "soap")


@pytest.mark.slow  # CI budget; the threaded tests and optim-blockwise's gloo test stay in CI
@pytest.mark.multiprocess
def test_soap_on_fully_shard_on_gloo_4_ranks() -> None:
    _check("soap", 4, run_processes(_gloo, 4, timeout=300))
