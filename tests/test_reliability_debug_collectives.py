"""Muon's ``step()`` called twice on one rank (real gloo processes): with the collective debug
mode (``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1``) every rank raises ``CollectiveMismatchError``
within 30 s, naming both sides, instead of gloo aborting the process ("Is there a distributed
collective mismatch", found by the adversarial runs of issue 14). The other run-time cases are in
packages/fsdp-engine/tests/test_engine_reliability_disagreement.py."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import optim_blockwise as ob
from fsdp_engine import fully_shard
from ragged_dtensor import CollectiveMismatchError
from ragged_dtensor.testing import run_processes

DEADLINE_S = 30.0


def _muon_twice(rank: int, world: int) -> tuple[str, float]:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh, block_policy=ob.Muon.block_policy())
    opt = ob.Muon(model.parameters(), lr=1e-2, ns_dtype=torch.float32)
    start = time.monotonic()
    try:
        for step in range(2):
            x = torch.randn(8, 16, generator=gen)
            F.mse_loss(model(x[rank::world]), x[rank::world]).backward()
            opt.step()
            if step == 0 and rank == 0:
                opt.step()  # the bug: a second step on one rank
            opt.zero_grad()
    except CollectiveMismatchError as exc:
        return f"CollectiveMismatchError: {exc}", time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.multiprocess
def test_muon_stepping_twice_on_one_rank_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAGGED_DTENSOR_DEBUG_COLLECTIVES", "1")  # spawned ranks inherit it
    monkeypatch.delenv("RAGGED_DTENSOR_DEBUG_TIMEOUT", raising=False)
    outcomes = run_processes(_muon_twice, 2, timeout=180)
    messages = {message for message, _ in outcomes}
    assert len(messages) == 1, messages  # the same verdict on both ranks
    message = messages.pop()
    assert message.startswith("CollectiveMismatchError: collective mismatch on process group")
    assert "ranks [0] are at" in message and "ranks [1] are at" in message, message
    assert "at step 1" in message and "at step 0" not in message.split("ranks [0]")[0]
    # rank 0 is in its second step, at Muon's owner exchange (a steady-state step runs no
    # agreement check: issue 18); rank 1 in the next forward's all-gather
    assert "all_to_all_single(dtypes uint8; sizes may differ) at step 1" in message, message
    # innermost and outermost package frames: the owner exchange, inside the optimizers'
    # shared step (base.py since issue 27's one step skeleton), called from _muon_twice
    assert "optim_blockwise/_private/exchange.py" in message, message
    assert "optim_blockwise/_private/base.py" in message and "_muon_twice" in message, message
    assert "all_gather_into_tensor" in message and "fsdp_engine/_private/hooks.py" in message
    for _, seconds in outcomes:
        assert seconds < DEADLINE_S
