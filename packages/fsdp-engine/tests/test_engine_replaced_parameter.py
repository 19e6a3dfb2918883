"""A parameter replaced after a step (``module.weight = nn.Parameter(...)``) is taken over at the
next forward, like one process uses it; a wrong shape raises naming the parameter ([Note:
registered parameters]).

Numeric kind: every rank trains on the same data, so the reduced gradient (the mean of equal
fp32 values) is each rank's own, and the sharded run equals one process bitwise (same kernels
on the same shapes). torch's FSDP2 is put beside: it drops the replacement (its next forward
uses the old weight), so its loss after the replacement differs from one process's.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import Stack, data, engine, make, shard_stack
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from ragged_dtensor.testing import run_threaded


def _train(model: Any, replace: Any) -> dict[str, Any]:
    """Two steps, the replacement, two more steps (the optimizer built at the start holds the
    old parameter, as it would in one process)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(4):
        if step == 2:
            replace(model)
        loss = model(data(0, step)).square().mean()  # the same data on every rank
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weight = model.blocks[1].up.weight
    full = weight.full_tensor() if hasattr(weight, "full_tensor") else weight
    return {"losses": losses, "weight": full.detach().clone()}


def _replace_up(model: Any) -> None:
    up = model.blocks[1].up  # Linear(8, 12): weight (12, 8)
    up.weight = nn.Parameter(torch.randn(12, 8, generator=torch.Generator().manual_seed(7)))


def _sharded(rank: int, world: int, name: str) -> dict[str, Any]:
    model: Any = make(Stack)
    shard_stack(engine(name), model, mesh=init_device_mesh("cpu", (world,)))
    return _train(model, _replace_up)


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread for the one-process reference, as each threaded rank runs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_a_parameter_replaced_after_a_step_is_taken_over_at_the_next_forward() -> None:
    reference = _train(make(Stack), _replace_up)  # one process
    ours = run_threaded(_sharded, 2, "ours")
    fsdp2 = run_threaded(_sharded, 2, "fsdp2")
    for result in ours:
        assert result["losses"] == reference["losses"]
        assert torch.equal(result["weight"], reference["weight"])
    # the control: FSDP2 agrees before the replacement and drops it
    for result in fsdp2:
        assert result["losses"][:2] == reference["losses"][:2]
        assert result["losses"][2] != reference["losses"][2]


def _wrong_shape(rank: int, world: int) -> str:
    model: Any = make(Stack)
    shard_stack(engine("ours"), model, mesh=init_device_mesh("cpu", (world,)))
    model(data(rank)).sum().backward()
    model.blocks[1].up.weight = nn.Parameter(torch.zeros(8, 8))
    try:
        model(data(rank)).sum().backward()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_replacement_of_the_wrong_shape_raises_naming_the_parameter() -> None:
    for message in run_threaded(_wrong_shape, 2):
        assert message == (
            "parameter 'up.weight': the assigned value has shape (8, 8), fully_shard manages "
            "it with shape (12, 8)"
        ), message


def _while_unsharded(rank: int, world: int) -> str:
    model: Any = make(Stack)
    shard_stack(engine("ours"), model, mesh=init_device_mesh("cpu", (world,)))
    loss = model(data(rank)).sum()  # the root keeps its parameters unsharded for backward
    model.proj.weight = nn.Parameter(torch.zeros(8, 8))
    try:
        loss.backward()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_replacement_while_unsharded_raises_instead_of_being_dropped() -> None:
    """Between a forward and its backward the root's parameters are unsharded: registering
    the sharded ones at its reshard would drop the replacement, so the reshard refuses it."""
    for message in run_threaded(_while_unsharded, 2):
        assert message.startswith(
            "parameter 'proj.weight' was replaced while fully_shard held it unsharded"
        ), message


def test_an_unreplaced_model_trains_as_before() -> None:
    """No replacement: the check at each unshard changes nothing (one process, bitwise)."""
    reference = _train(make(Stack), lambda model: None)
    for result in run_threaded(_sharded_plain, 2, "ours"):
        assert result["losses"] == reference["losses"]


def _sharded_plain(rank: int, world: int, name: str) -> dict[str, Any]:
    model: Any = make(Stack)
    shard_stack(engine(name), model, mesh=init_device_mesh("cpu", (world,)))
    return _train(model, lambda model: None)
