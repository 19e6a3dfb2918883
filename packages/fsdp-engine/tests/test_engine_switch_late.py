"""A switch turned on late never mixes engines: torch's policies made before it are accepted,
modules that bound torch's names at their import are rebound, one model sharded by both engines
is refused at lazy init, and no thread ends another thread's block ([Note: the switch],
[Note: one engine per model]).

Numeric kind: training through torch's names under the switch runs fsdp_engine on the same
values in the same order as calling fsdp_engine directly: bitwise. torch's FSDP2 (the control,
switch off) runs the same fp32 arithmetic on this model: its losses are compared bitwise too
(``test_engine_training_parity.py`` pins that the two engines agree bit for bit here).
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import Stack, data, make
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fsdp2_impl
from torch.distributed.tensor import init_device_mesh

import fsdp_engine
from fsdp_engine._private.switch import switched_names
from ragged_dtensor.testing import run_threaded


@pytest.fixture(autouse=True)
def switch_off() -> Iterator[None]:
    assert not fsdp_engine.used_as_torch_fsdp()
    try:
        yield
    finally:
        fsdp_engine.restore_torch_fsdp()


def _losses(model: torch.nn.Module, rank: int) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = model(data(rank, step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


# -- torch's policy objects made before the switch ---------------------------------------------


def _policies() -> dict[str, Any]:
    """Made from torch's classes, as an ``Accelerator`` or ``Trainer`` built before the switch
    makes them (read from torch's namespace now: the test switches on only afterwards)."""
    return {
        "mp_policy": torch_fsdp.MixedPrecisionPolicy(reduce_dtype=torch.float32),
        "offload_policy": torch_fsdp.CPUOffloadPolicy(pin_memory=False),
    }


def _train_with(rank: int, world: int, policies: dict[str, Any], how: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    model = make(Stack)
    shard: Any = {
        "switched": torch_fsdp.fully_shard,  # torch's name: ours while the switch is on
        "ours": fsdp_engine.fully_shard,
        "fsdp2": torch_fsdp2_impl.fully_shard,
    }[how]
    for block in model.blocks:
        shard(block, mesh=mesh, **policies)
    shard(model, mesh=mesh, **policies)
    return {"losses": _losses(model, rank), "ours": isinstance(model, fsdp_engine.FSDPModule)}


@pytest.mark.parametrize("which", ["mp_policy", "offload_policy", "both"])
def test_torchs_policies_made_before_the_switch_are_accepted(which: str) -> None:
    made = _policies()
    policies = made if which == "both" else {which: made[which]}
    for policy in policies.values():
        assert type(policy).__module__.startswith("torch.")  # torch's own classes
    control = run_threaded(_train_with, 2, policies, "fsdp2")
    direct = run_threaded(_train_with, 2, policies, "ours")
    with fsdp_engine.as_torch_fsdp():
        assert torch_fsdp.OffloadPolicy is fsdp_engine.OffloadPolicy  # the name is ours now
        switched = run_threaded(_train_with, 2, policies, "switched")
    for got, want, fsdp2 in zip(switched, direct, control, strict=True):
        assert got["ours"] and want["ours"] and not fsdp2["ours"]
        assert got["losses"] == want["losses"] == fsdp2["losses"]


def test_a_foreign_policy_is_refused_naming_its_class() -> None:
    class NotAPolicy:
        pass

    model = torch.nn.Linear(2, 2)
    with (
        fsdp_engine.as_torch_fsdp(),
        pytest.raises(TypeError, match=r"offload_policy must be .* got .*NotAPolicy"),
    ):
        torch_fsdp.fully_shard(model, offload_policy=NotAPolicy())


# -- modules that bound torch's names at their import ------------------------------------------

_TRAINER = '''
"""A trainer module that binds FSDP2's names at its import (torchtitan's fsdp.py, a Lightning
module whose configure_model calls fully_shard)."""
from torch.distributed._composable.fsdp import FSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import fully_shard as torch_fully_shard_alias

POLICY = MixedPrecisionPolicy


def shard(model, mesh):
    for block in model.blocks:
        torch_fully_shard_alias(block, mesh=mesh, mp_policy=POLICY())
    fully_shard(model, mesh=mesh)
    return [isinstance(m, FSDPModule) for m in model.modules()]
'''


@pytest.fixture
def trainer_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = f"engine_switch_late_trainer_{os.getpid()}_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _train_trainer(rank: int, world: int, trainer_name: str) -> dict[str, Any]:
    trainer: Any = sys.modules[trainer_name]
    mesh = init_device_mesh("cpu", (world,))
    model = make(Stack)
    trainer.shard(model, mesh)
    return {
        "losses": _losses(model, rank),
        "ours": [isinstance(m, fsdp_engine.FSDPModule) for m in (model, *model.blocks)],
    }


def test_a_module_that_bound_torchs_names_before_the_switch_is_rebound(trainer_module: str) -> None:
    trainer: Any = importlib.import_module(trainer_module)  # before the switch: torch's objects
    table = switched_names()
    theirs = {n: t for n, (t, _) in table.items()}
    control = run_threaded(_train_trainer, 2, trainer_module)  # switch off: torch's FSDP2
    assert all(r["ours"] == [False, False, False] for r in control)
    with fsdp_engine.as_torch_fsdp():
        assert trainer.fully_shard is fsdp_engine.fully_shard
        assert trainer.torch_fully_shard_alias is fsdp_engine.fully_shard  # aliases too
        assert trainer.FSDPModule is fsdp_engine.FSDPModule
        assert trainer.POLICY is fsdp_engine.MixedPrecisionPolicy
        switched = run_threaded(_train_trainer, 2, trainer_module)
    for got, fsdp2 in zip(switched, control, strict=True):
        assert got["ours"] == [True, True, True]  # the whole model is ours
        assert got["losses"] == fsdp2["losses"]
    # removal puts torch's very objects back
    assert trainer.fully_shard is theirs["fully_shard"]
    assert trainer.torch_fully_shard_alias is theirs["fully_shard"]
    assert trainer.FSDPModule is theirs["FSDPModule"]
    assert trainer.POLICY is theirs["MixedPrecisionPolicy"]


def test_a_global_that_cannot_be_rebound_refuses_the_switch(trainer_module: str) -> None:
    trainer = importlib.import_module(trainer_module)

    class Frozen(type(trainer)):  # type: ignore[misc]
        def __setattr__(self, name: str, value: object) -> None:
            if value is fsdp_engine.fully_shard:
                raise AttributeError("read-only module")
            super().__setattr__(name, value)

    trainer.__class__ = Frozen
    before = dict(vars(trainer))
    with pytest.raises(fsdp_engine.TorchFSDPSwitchError, match=rf"cannot switch {trainer_module}"):
        fsdp_engine.use_as_torch_fsdp()
    assert not fsdp_engine.used_as_torch_fsdp()
    assert all(vars(trainer)[k] is v for k, v in before.items())  # nothing changed


# -- one model, one engine ----------------------------------------------------------------------


def _mixed(rank: int, world: int, blocks_by: str) -> str:
    mesh = init_device_mesh("cpu", (world,))
    model = make(Stack)
    torchs, ours = torch_fsdp2_impl.fully_shard, fsdp_engine.fully_shard
    block_shard, root_shard = (torchs, ours) if blocks_by == "fsdp2" else (ours, torchs)
    try:
        for block in model.blocks:
            block_shard(block, mesh=mesh)
        if blocks_by == "fsdp2":
            root_shard(model, mesh=mesh)
        else:  # torch's fully_shard refuses our DTensors unless told to leave them alone
            root_shard(model, mesh=mesh, ignored_params=set(model.blocks.parameters()))
        model(data(rank)).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_one_model_sharded_by_both_engines_is_refused() -> None:
    """Blocks by one engine and the root by the other (what a module that kept torch's
    ``fully_shard`` does): refused on every rank, naming each engine's modules. Ours over
    torch's blocks: at our ``fully_shard`` (their parameters are torch's DTensors already).
    torch's root over our blocks: torch's ``fully_shard`` fails on our DTensors by itself
    unless they are its ``ignored_params``; then at our lazy init, in the first forward.
    Sharded by one engine, the same model trains (the other tests)."""
    blocks, root = "['blocks.0', 'blocks.1']", "['<root FSDPStack>']"
    for message in run_threaded(_mixed, 2, "fsdp2"):
        assert f"fsdp_engine was asked to shard Stack, whose modules {blocks} are sharded by " in (
            message
        ), message
        assert "one model must be sharded by one engine" in message
    for message in run_threaded(_mixed, 2, "ours"):
        assert "one model is sharded by two engines" in message, message
        assert f"fsdp_engine shards {blocks}; torch's FSDP2 shards {root}" in message, message


def _two_models(rank: int, world: int) -> list[float]:
    """A model of each engine side by side in one process (a comparison) is not mixing."""
    mesh = init_device_mesh("cpu", (world,))
    a, b = make(Stack), make(Stack)
    fsdp_engine.fully_shard(a, mesh=mesh)
    torch_fsdp2_impl.fully_shard(b, mesh=mesh)
    return [a(data(rank)).sum().item(), b(data(rank)).sum().item()]


def test_a_model_of_each_engine_side_by_side_is_not_mixing() -> None:
    for ours, theirs in run_threaded(_two_models, 2):
        assert ours == theirs


# -- threads ------------------------------------------------------------------------------------


def test_restore_on_another_thread_cannot_end_this_threads_block() -> None:
    inside, tried, leave = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def worker() -> None:
        with fsdp_engine.as_torch_fsdp():
            inside.set()
            tried.wait(20)
            seen["still on in the block"] = torch_fsdp.fully_shard is fsdp_engine.fully_shard
            leave.wait(20)

    thread = threading.Thread(target=worker, name="rank-1-block")
    thread.start()
    try:
        assert inside.wait(20)
        fsdp_engine.use_as_torch_fsdp()
        with pytest.raises(
            fsdp_engine.TorchFSDPSwitchError,
            match=r"as_torch_fsdp blocks of other threads \(rank-1-block\) still hold the "
            r"switch; it stays on until they leave",
        ):
            fsdp_engine.restore_torch_fsdp()
        assert fsdp_engine.used_as_torch_fsdp()
        tried.set()
    finally:
        tried.set()
        leave.set()
        thread.join(20)
    assert seen == {"still on in the block": True}
    assert fsdp_engine.used_as_torch_fsdp()  # use_as_torch_fsdp() still holds it
    fsdp_engine.restore_torch_fsdp()  # no other block now
    assert not fsdp_engine.used_as_torch_fsdp()
