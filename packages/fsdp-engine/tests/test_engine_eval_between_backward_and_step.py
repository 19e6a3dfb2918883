"""An eval forward under ``no_grad`` between ``backward()`` and ``step()`` leaves nothing
unsharded: the next training forward gathers the stepped shards, never a copy older than them.

Numeric kind: every rank trains on the same data, so the reduced gradient is each rank's own
and the sharded run equals one process bitwise (same kernels, same shapes, one intra-op
thread). torch's FSDP2 is put beside: its root keeps the copy gathered by the eval forward
and trains the next step on pre-step weights, so its losses leave one process's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_fsdp2 import Stack, data, engine, make, shard_stack
from torch.distributed.device_mesh import init_device_mesh

from ragged_dtensor.testing import run_threaded


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _train(model: Any, evaluate: bool) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        loss = model(data(0, step)).square().mean()  # the same data on every rank
        loss.backward()
        if evaluate:
            model.eval()
            with torch.no_grad():
                model(data(0, 100 + step))
            model.train()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded(rank: int, world: int, name: str, evaluate: bool, reshard: bool | None) -> list[float]:
    model: Any = make(Stack)
    mesh = init_device_mesh("cpu", (world,))
    shard_stack(engine(name), model, mesh=mesh, reshard_after_forward=reshard)
    return _train(model, evaluate)


@pytest.mark.parametrize("reshard", [None, False], ids=["default", "reshard_after_forward=False"])
def test_an_eval_forward_between_backward_and_step_leaves_no_stale_copy(
    reshard: bool | None,
) -> None:
    reference = _train(make(Stack), evaluate=True)  # one process
    assert reference == _train(make(Stack), evaluate=False)  # eval changes nothing there
    for losses in run_threaded(_sharded, 2, "ours", True, reshard):
        assert losses == reference
    fsdp2 = run_threaded(_sharded, 2, "fsdp2", True, reshard)
    for losses in fsdp2:  # beside: FSDP2's next forward uses the copy the eval gathered
        assert losses[0] == reference[0]
        assert losses[1:] != reference[1:]
