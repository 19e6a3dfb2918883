"""The switch ([Note: the switch] in ``_private/switch.py``): torch's FSDP2 names resolve to
fsdp_engine's while it is on, and removing it puts torch's very objects back.

The whole-of-torch checks run in a fresh interpreter, so that the import order is real (torch,
then fsdp_engine, then the switch); the rest runs here, each test restoring the switch.

Numeric kind: training through torch's names under the switch runs fsdp_engine on the same
values in the same order as calling fsdp_engine directly (same arithmetic): bitwise.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import Mlp, Stack, data, make, shard_stack
from engine_subclass import CALLS, ScaledWeight
from torch.distributed._composable import fsdp as composable_fsdp
from torch.distributed.fsdp import _fully_shard as torch_fully_shard_pkg
from torch.distributed.fsdp._fully_shard import _fully_shard as torch_fsdp2_impl
from torch.distributed.tensor import init_device_mesh

import fsdp_engine
from fsdp_engine._private.switch import TORCH_NAMESPACES, switched_names
from ragged_dtensor.testing import run_threaded

# What issue 26 asks to resolve to ours (switched_names() may hold more as fsdp_engine grows).
REQUIRED = (
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
)


@pytest.fixture(autouse=True)
def switch_off() -> Iterator[None]:
    """Every test starts and ends with torch's FSDP2 (a failing test must not leave it on)."""
    assert not fsdp_engine.used_as_torch_fsdp()
    try:
        yield
    finally:
        fsdp_engine.restore_torch_fsdp()


def _namespaces() -> list[ModuleType]:
    return [importlib.import_module(name) for name in TORCH_NAMESPACES]


def _snapshot() -> dict[tuple[str, str], object]:
    return {(m.__name__, n): v for m in _namespaces() for n, v in vars(m).items()}


# -- what the switch rebinds -------------------------------------------------------------------


def test_the_switched_names_are_fsdp2s_names_that_fsdp_engine_exports() -> None:
    table = switched_names()
    torch_all = torch_fully_shard_pkg.__all__
    exported = {n for n in torch_all if n in fsdp_engine.__all__}
    shared = {n for n in exported if getattr(fsdp_engine, n) is getattr(torch_fsdp, n)}
    assert set(table) == exported - shared
    assert shared == {"DataParallelMeshDims"}  # torch's own class, re-exported: nothing to switch
    assert set(REQUIRED) <= set(table)
    public = ("use_as_torch_fsdp", "restore_torch_fsdp", "as_torch_fsdp", "used_as_torch_fsdp")
    assert {*public, "TorchFSDPSwitchError"} <= set(fsdp_engine.__all__)
    for name, (theirs, ours) in table.items():
        assert theirs is getattr(torch_fsdp, name), name  # torch's own object
        assert ours is getattr(fsdp_engine, name), name


def test_fsdp2s_names_resolve_to_ours_in_every_namespace_and_come_back_identical() -> None:
    before = _snapshot()
    table = switched_names()
    with fsdp_engine.as_torch_fsdp():
        assert fsdp_engine.used_as_torch_fsdp()
        during = _snapshot()
        for (module, name), value in before.items():
            if name in table:
                assert during[(module, name)] is table[name][1], (module, name)
            else:  # everything else is untouched (DataParallelMeshDims: torch's own class)
                assert during[(module, name)] is value, (module, name)
        assert set(during) == set(before)  # no name added
        # the import statements trainers write
        from torch.distributed._composable.fsdp import FSDPModule as ComposableFSDPModule
        from torch.distributed.fsdp import (
            CPUOffloadPolicy,
            FSDPModule,
            MixedPrecisionPolicy,
            OffloadPolicy,
            UnshardHandle,
            fully_shard,
            register_fsdp_forward_method,
        )

        assert fully_shard is fsdp_engine.fully_shard
        assert FSDPModule is ComposableFSDPModule is fsdp_engine.FSDPModule
        assert MixedPrecisionPolicy is fsdp_engine.MixedPrecisionPolicy
        assert OffloadPolicy is fsdp_engine.OffloadPolicy
        assert CPUOffloadPolicy is fsdp_engine.CPUOffloadPolicy
        assert UnshardHandle is fsdp_engine.UnshardHandle
        assert register_fsdp_forward_method is fsdp_engine.register_fsdp_forward_method
        # FSDP2's implementation is never rebound: torch's own fully_shard stays whole
        assert torch_fsdp2_impl.FSDPModule is table["FSDPModule"][0]
        assert torch_fsdp2_impl.fully_shard is table["fully_shard"][0]
    assert not fsdp_engine.used_as_torch_fsdp()
    after = _snapshot()
    assert after.keys() == before.keys()
    assert [k for k in before if after[k] is not before[k]] == []


def test_use_and_restore_are_idempotent() -> None:
    fsdp_engine.use_as_torch_fsdp()
    fsdp_engine.use_as_torch_fsdp()
    assert torch_fsdp.fully_shard is fsdp_engine.fully_shard
    fsdp_engine.restore_torch_fsdp()
    assert torch_fsdp.fully_shard is switched_names()["fully_shard"][0]
    fsdp_engine.restore_torch_fsdp()  # off already: nothing to do
    assert not fsdp_engine.used_as_torch_fsdp()


# -- holders: nesting, threads, the explicit switch ---------------------------------------------


def test_blocks_nest_and_the_outermost_holder_turns_it_off() -> None:
    with fsdp_engine.as_torch_fsdp():
        with fsdp_engine.as_torch_fsdp():
            assert fsdp_engine.used_as_torch_fsdp()
        assert fsdp_engine.used_as_torch_fsdp()  # the outer block still holds it
    assert not fsdp_engine.used_as_torch_fsdp()
    fsdp_engine.use_as_torch_fsdp()
    with fsdp_engine.as_torch_fsdp():
        pass
    assert fsdp_engine.used_as_torch_fsdp()  # use_as_torch_fsdp() holds it until restore
    with fsdp_engine.as_torch_fsdp():
        fsdp_engine.restore_torch_fsdp()  # restore removes everything, even inside a block
        assert not fsdp_engine.used_as_torch_fsdp()
    assert not fsdp_engine.used_as_torch_fsdp()


def test_each_thread_may_hold_a_block_of_its_own() -> None:
    """The ranks of a threaded process group can each enter ``as_torch_fsdp``: one leaving its
    block does not switch the other's FSDP2 off."""
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, bool] = {}

    def first() -> None:
        with fsdp_engine.as_torch_fsdp():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second() -> None:
        first_in.wait(10)
        with fsdp_engine.as_torch_fsdp():
            second_in.set()
            first_out.wait(10)
            seen["after the first left"] = torch_fsdp.fully_shard is fsdp_engine.fully_shard

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert seen == {"after the first left": True}
    assert not fsdp_engine.used_as_torch_fsdp()


# -- refusals -----------------------------------------------------------------------------------


def test_restore_refuses_when_a_binding_was_replaced_since(monkeypatch: pytest.MonkeyPatch) -> None:
    fsdp_engine.use_as_torch_fsdp()
    during = _snapshot()

    def someone_elses(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not called")

    monkeypatch.setattr(torch_fsdp, "fully_shard", someone_elses)
    with pytest.raises(
        fsdp_engine.TorchFSDPSwitchError,
        match=r"torch\.distributed\.fsdp\.fully_shard no longer holds fsdp_engine's object",
    ):
        fsdp_engine.restore_torch_fsdp()
    assert fsdp_engine.used_as_torch_fsdp()  # nothing was changed
    changed = [k for k, v in _snapshot().items() if v is not during[k]]
    assert changed == [("torch.distributed.fsdp", "fully_shard")]
    monkeypatch.undo()
    fsdp_engine.restore_torch_fsdp()
    assert torch_fsdp.fully_shard is switched_names()["fully_shard"][0]


def test_switching_on_refuses_over_someone_elses_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    other = type("OtherPolicy", (), {})
    monkeypatch.setattr(composable_fsdp, "MixedPrecisionPolicy", other)
    before = _snapshot()
    with pytest.raises(
        fsdp_engine.TorchFSDPSwitchError,
        match=r"torch\.distributed\._composable\.fsdp\.MixedPrecisionPolicy is not torch's "
        r"FSDP2 object but .*OtherPolicy",
    ):
        fsdp_engine.use_as_torch_fsdp()
    assert not fsdp_engine.used_as_torch_fsdp()
    assert all(v is before[k] for k, v in _snapshot().items())


def test_bad_modules_are_named() -> None:
    with pytest.raises(TypeError, match="must hold modules or dotted module names, got int"):
        fsdp_engine.use_as_torch_fsdp(modules=[3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"torch\.distributed\.fsdp is one of torch's modules"):
        fsdp_engine.use_as_torch_fsdp(modules=[torch_fsdp])
    with pytest.raises(ValueError, match=r"module json holds none of torch's FSDP2 objects"):
        fsdp_engine.use_as_torch_fsdp(modules=["json"])
    with pytest.raises(ModuleNotFoundError):
        fsdp_engine.use_as_torch_fsdp(modules=["no_such_trainer_module"])
    assert not fsdp_engine.used_as_torch_fsdp()


# -- names bound at import ----------------------------------------------------------------------

_TRAINER = '''
"""A trainer module that binds FSDP2's names at its import, as torchtitan's fsdp.py does."""
from torch.distributed._composable.fsdp import FSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp import fully_shard as torch_fully_shard_alias


def shard(model, mesh):
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MixedPrecisionPolicy())
    fully_shard(model, mesh=mesh)
    return [isinstance(m, FSDPModule) for m in model.modules()]
'''


@pytest.fixture
def trainer_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The name of a fresh trainer-like module (not imported yet)."""
    name = f"engine_switch_trainer_{os.getpid()}_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(_TRAINER)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_named_trainer_module_is_switched_and_restored(trainer_module: str) -> None:
    theirs = {n: t for n, (t, _) in switched_names().items()}
    # by name: imported before the switch flips (so it binds torch's), then rebound
    with fsdp_engine.as_torch_fsdp(modules=[trainer_module]):
        trainer = sys.modules[trainer_module]
        assert trainer.fully_shard is fsdp_engine.fully_shard
        assert trainer.FSDPModule is fsdp_engine.FSDPModule
        assert trainer.MixedPrecisionPolicy is fsdp_engine.MixedPrecisionPolicy
        assert trainer.torch_fully_shard_alias is fsdp_engine.fully_shard  # every global of it
        # a block naming it again while it is on holds it too: leaving that one changes nothing
        with fsdp_engine.as_torch_fsdp(modules=[trainer]):
            pass
        assert trainer.fully_shard is fsdp_engine.fully_shard
    assert trainer.fully_shard is theirs["fully_shard"]
    assert trainer.torch_fully_shard_alias is theirs["fully_shard"]
    assert trainer.FSDPModule is theirs["FSDPModule"]
    assert trainer.MixedPrecisionPolicy is theirs["MixedPrecisionPolicy"]


def test_a_trainer_imported_while_the_switch_is_on_binds_ours(trainer_module: str) -> None:
    with fsdp_engine.as_torch_fsdp():
        trainer = importlib.import_module(trainer_module)
        assert trainer.fully_shard is fsdp_engine.fully_shard
    # documented: a module outside torch imported while on keeps what it bound
    assert trainer.fully_shard is fsdp_engine.fully_shard


# -- training through torch's names -------------------------------------------------------------


def _train(rank: int, world: int, through_torch: bool) -> dict[str, Any]:
    """Three steps of the ``Stack`` model sharded through ``torch.distributed.fsdp``'s names
    (under the switch) or fsdp_engine's."""
    api: Any = torch_fsdp if through_torch else fsdp_engine
    mesh = init_device_mesh("cpu", (world,))
    model = make(Stack)
    policy = api.MixedPrecisionPolicy(reduce_dtype=torch.float32)
    shard_stack(api, model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = model(data(rank, step)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    block = model.blocks[0]
    return {
        "losses": losses,
        "ours": isinstance(block, fsdp_engine.FSDPModule),
        "fsdp_module": isinstance(block, api.FSDPModule),
        "class": type(block).__mro__[1],
        "policy": type(policy),
    }


def test_training_through_torchs_names_runs_our_engine_bitwise() -> None:
    direct = run_threaded(_train, 2, False)
    with fsdp_engine.as_torch_fsdp():
        switched = run_threaded(_train, 2, True)
    for got, want in zip(switched, direct, strict=True):
        assert got["losses"] == want["losses"]
        assert got["ours"] and got["fsdp_module"] and got["class"] is fsdp_engine.FSDPModule
        assert got["policy"] is fsdp_engine.MixedPrecisionPolicy
    # switched off: the same code runs torch's FSDP2 again
    for result in run_threaded(_train, 2, True):
        assert not result["ours"] and result["fsdp_module"]
        assert result["class"] is torch_fsdp2_impl.FSDPModule


def _sharded_mlp_forward(rank: int, world: int) -> tuple[bool, bool]:
    mesh = init_device_mesh("cpu", (world,))
    model = make(Mlp)
    torch_fsdp.fully_shard(model, mesh=mesh)
    torch_fsdp.register_fsdp_forward_method(model, "forward")
    handle = model.unshard(async_op=True)  # type: ignore[operator]
    assert handle is not None
    handle.wait()
    model.reshard()  # type: ignore[operator]
    return isinstance(handle, torch_fsdp.UnshardHandle), isinstance(model, torch_fsdp.FSDPModule)


def test_fsdp_module_methods_through_torchs_names() -> None:
    with fsdp_engine.as_torch_fsdp():
        results = run_threaded(_sharded_mlp_forward, 2)
    assert results == [(True, True), (True, True)]


def _extension_forward(rank: int, world: int) -> None:
    """A ``ScaledWeight`` layer sharded through torch's names under the switch, one step."""
    layer = make(lambda: torch.nn.Linear(8, 12))
    layer.weight = torch.nn.Parameter(ScaledWeight(layer.weight.detach().clone()))
    torch_fsdp.fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    layer(data(rank, 0)).square().mean().backward()


def test_extension_hooks_get_torchs_policy_type_under_the_switch() -> None:
    """``fsdp_pre_all_gather`` receives the policy as FSDP2 passes it, torch's
    ``MixedPrecisionPolicy``, also while ``torch.distributed.fsdp.MixedPrecisionPolicy`` is
    ours (the engine binds torch's class at import)."""
    CALLS.clear()
    with fsdp_engine.as_torch_fsdp():
        run_threaded(_extension_forward, 2)
    assert CALLS["pre"] > 0
    assert CALLS["pre_policy_torch"] == CALLS["pre"], dict(CALLS)


# -- the whole of torch, in a fresh interpreter -------------------------------------------------

_SCRIPT = r"""
import importlib, json, sys, types, warnings

import torch
import torch.distributed.fsdp
import torch.distributed._composable.fsdp.fully_shard
import torch.distributed._composable.replicate_with_fsdp  # what the switch imports first
import torch._dynamo  # torch's own import-time changes (torch.manual_seed), before the scans


def scan():
    out = {}
    for mname, module in list(sys.modules.items()):
        if module is None or not (mname == "torch" or mname.startswith("torch.")):
            continue
        for key, value in list(vars(module).items()):
            out[(mname, key)] = value
            if isinstance(value, type) and getattr(value, "__module__", None) == mname:
                for ckey, cvalue in list(vars(value).items()):
                    out[(mname, key, ckey)] = cvalue
    return out


MISSING = object()


def changed(before, after):
    return sorted(str(k) for k, v in before.items() if k not in after or after[k] is not v)


result = {}
first = scan()
import fsdp_engine
from fsdp_engine._private.switch import switched_names
imported = scan()
result["import changed"] = changed(first, imported)
table = switched_names()
ours = {id(o) for _, o in table.values()}

fsdp_engine.use_as_torch_fsdp()
during = scan()
# module attributes; the classes torch's modules define are checked on the class objects
# (while on, a namespace's name leads to our class, whose attributes are not torch's)
result["on changed"] = changed(
    {k: v for k, v in imported.items() if len(k) == 2},
    {k: v for k, v in during.items() if len(k) == 2},
)
result["on class attributes changed"] = sorted(
    str(k) for k, v in imported.items()
    if len(k) == 3 and vars(imported[k[:2]]).get(k[2], MISSING) is not v
)
result["on holds ours"] = all(
    during[k] is table[k[1]][1]
    for k in imported if len(k) == 2 and during.get(k) is not imported[k]
)
# a torch module imported while the switch is on binds ours...
import torch.distributed.pipelining.stage as stage
result["late torch module during"] = [stage.fully_shard is fsdp_engine.fully_shard,
                                      stage.FSDPModule is fsdp_engine.FSDPModule]
fsdp_engine.restore_torch_fsdp()
after = scan()
result["off changed"] = changed(imported, after)
result["off added keys holding ours"] = sorted(
    str(k) for k, v in after.items() if k not in imported and id(v) in ours
)
# ...and torch's back when the switch is removed
result["late torch module after"] = [stage.fully_shard is table["fully_shard"][0],
                                     stage.FSDPModule is table["FSDPModule"][0]]
print(json.dumps(result))
"""


@pytest.mark.multiprocess
def test_switching_on_then_off_leaves_every_torch_object_identical() -> None:
    """Importing fsdp_engine changes nothing in torch; the switch changes exactly the switched
    names in torch's four namespaces; removing it leaves every attribute of every loaded torch
    module (and of the classes they define) the very object it was, and a torch module first
    imported while it was on holds torch's objects again."""
    done = subprocess.run(
        [sys.executable, "-c", _SCRIPT],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["import changed"] == []
    names = switched_names()
    expected = sorted(
        str((space, name))
        for space in TORCH_NAMESPACES
        for name in names
        if name in vars(importlib.import_module(space))
    )
    assert result["on changed"] == expected
    assert {str(("torch.distributed.fsdp", n)) for n in REQUIRED} <= set(expected)
    assert result["on class attributes changed"] == []
    assert result["on holds ours"] is True
    assert result["late torch module during"] == [True, True]
    assert result["off changed"] == []
    assert result["off added keys holding ours"] == []
    assert result["late torch module after"] == [True, True]
