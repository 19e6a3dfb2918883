"""Importing the packages changes nothing in torch (issue 27); the DTensor integration is installed
by the first RaggedShard (or explicitly), refuses targets that are not torch's own functions, and
its removal puts torch's very objects back.

The import checks run in fresh interpreters, so that the import order is real: torch first, then
``ragged_dtensor``, ``dbuffer``, ``optim_blockwise``, ``fsdp_engine``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from ragged_dtensor import (
    DTensorIntegrationError,
    RaggedShard,
    distribute_tensor,
    dtensor_integration,
    dtensor_integration_installed,
    hooks_installed,
    install_dtensor_integration,
    uninstall_dtensor_integration,
)
from ragged_dtensor.testing import run_threaded

# The script a fresh interpreter runs. It prints one JSON object.
_SCRIPT = r'''
import importlib, json, os, sys, types

import torch
import torch.distributed as dist

PRELOAD = json.loads(os.environ["RAGGED_TEST_PRELOAD"])
skipped = []
for name in PRELOAD:  # torch's own import-time effects happen before the first snapshot
    try:
        importlib.import_module(name)
    except Exception:
        skipped.append(name)

from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import _len_torch_dispatch_stack

MISSING = "<missing>"


def named_targets():
    """Every torch object any of our packages patches, or ever patched (by name)."""
    from torch.distributed.tensor import _api, _dispatch, _redistribute
    import torch.optim.optimizer as optimizer

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    out = {}
    for module in (_redistribute, _dispatch, _api):
        out[f"{module.__name__}.redistribute_local_tensor"] = vars(module).get(
            "redistribute_local_tensor", MISSING
        )
    out["_api.distribute_tensor"] = _api.distribute_tensor
    out["_api.distribute_tensor.__code__"] = _api.distribute_tensor.__code__
    out["torch.distributed.tensor.distribute_tensor"] = torch.distributed.tensor.distribute_tensor
    out["_api globals"] = tuple(sorted(k for k in vars(_api) if "ragged" in k))
    for name in ("from_local", "__create_write_items__", "__create_chunk_list__",
                 "__get_tensor_shard__", "redistribute", "full_tensor", "__new__", "data_ptr"):
        out[f"DTensor.{name}"] = vars(DTensor).get(name, MISSING)
    out["propagator instance attributes"] = tuple(sorted(vars(propagator)))
    for name in ("propagate_op_sharding", "propagate_op_sharding_non_cached"):
        out[f"propagator.{name}"] = vars(propagator).get(name, MISSING)
    out["dispatcher instance attributes"] = tuple(sorted(vars(dispatcher)))
    out["dispatcher._dispatch_get_local_results_slow_path"] = vars(dispatcher).get(
        "_dispatch_get_local_results_slow_path", MISSING
    )
    out["torch.UntypedStorage.resize_"] = vars(torch.UntypedStorage).get("resize_", MISSING)
    for name in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_gather",
                 "all_to_all_single", "broadcast", "all_gather_object", "batch_isend_irecv"):
        out[f"torch.distributed.{name}"] = getattr(dist, name)
    out["dispatch mode stack"] = _len_torch_dispatch_stack()
    out["torch-function mode stack"] = torch._C._len_torch_function_stack()
    out["global optimizer pre hooks"] = tuple(optimizer._global_optimizer_pre_hooks)
    out["global optimizer post hooks"] = tuple(optimizer._global_optimizer_post_hooks)
    return out


def scan():
    """Every attribute of every loaded torch module, and of the classes they define."""
    out = {}
    for mname, module in list(sys.modules.items()):
        if module is None or not (mname == "torch" or mname.startswith("torch.")):
            continue
        for key, value in list(vars(module).items()):
            out[(mname, key)] = value
            if isinstance(value, types.FunctionType):
                out[(mname, key, "__code__")] = value.__code__
            if isinstance(value, type) and getattr(value, "__module__", None) == mname:
                for ckey, cvalue in list(vars(value).items()):
                    out[(mname, key, ckey)] = cvalue
    return out


DATA = (int, float, bool, str, bytes, type(None), dict, list, set, tuple)


def same(a, b, data_may_change):
    """The same object; with ``data_may_change``, plain data (counters, caches, the threaded test
    group's bookkeeping that running ops updates) counts as the same too: a patch replaces a
    function, class or object, never an int."""
    if a is b or (isinstance(a, (int, str, tuple)) and a == b):
        return True
    return data_may_change and isinstance(a, DATA) and isinstance(b, DATA)


def differences(before, after, *, additions, data_may_change=False):
    changed = [
        str(k) for k, v in before.items() if k in after and not same(v, after[k], data_may_change)
    ]
    removed = [str(k) for k in before if k not in after]
    added = [
        str(k) for k, v in after.items()
        if additions and k not in before and not isinstance(v, types.ModuleType)
    ]
    return sorted(changed + removed + added)


result = {"skipped preloads": skipped}
first_targets, first_scan = named_targets(), scan()

import ragged_dtensor, dbuffer, optim_blockwise, fsdp_engine  # noqa: E401

targets = named_targets()
result["import: named targets changed"] = differences(first_targets, targets, additions=True)
result["import: torch attributes changed"] = differences(first_scan, scan(), additions=True)
result["import: integration installed"] = ragged_dtensor.dtensor_integration_installed()
result["import: collective checks on"] = ragged_dtensor.collective_checks_enabled()

# settle torch's own lazy state (threaded process group, DTensor caches) with standard placements
from torch.distributed.tensor import Shard, Replicate, init_device_mesh
from ragged_dtensor.testing import run_threaded


def work(rank, world, ragged):
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(6, 4, generator=gen)
    placement = ragged_dtensor.RaggedShard((0,), (1, 2)) if ragged else Shard(0)
    dt = ragged_dtensor.distribute_tensor(full, mesh, [placement])
    assert torch.equal(dt.full_tensor(), full)
    assert torch.equal(dt.redistribute(mesh, [Replicate()]).to_local(), full)
    replicated = ragged_dtensor.distribute_tensor(full, mesh, [Replicate()])
    back = replicated.redistribute(mesh, [placement])
    assert torch.equal((dt * 2 + back).full_tensor(), full * 3)
    assert torch.allclose(dt.sum().full_tensor(), full.sum())
    dt.uniform_(generator=torch.Generator().manual_seed(1))
    dt.__create_write_items__("w", dt)
    return True


assert run_threaded(work, 2, False) == [True, True]
settled_targets, settled_scan = named_targets(), scan()

with ragged_dtensor.dtensor_integration():
    during = named_targets()
    result["installed: named targets changed"] = differences(first_targets, during, additions=True)
    result["installed: parts"] = ragged_dtensor.hooks_installed()
    result["installed: collective checks on"] = ragged_dtensor.collective_checks_enabled()
    assert run_threaded(work, 2, True) == [True, True]

result["removed: named targets changed"] = differences(
    first_targets, named_targets(), additions=True
)
result["removed: torch attributes changed"] = differences(
    settled_scan, scan(), additions=False, data_may_change=True
)
result["removed: parts"] = ragged_dtensor.hooks_installed()
result["removed: collective checks on"] = ragged_dtensor.collective_checks_enabled()

# the first RaggedShard installs it; removing it again restores the same objects
ragged_dtensor.RaggedShard((0,), (1, 1))
result["lazy: installed"] = ragged_dtensor.dtensor_integration_installed()
ragged_dtensor.uninstall_dtensor_integration()
result["lazy removed: named targets changed"] = differences(
    first_targets, named_targets(), additions=True
)
print(json.dumps(result))
'''

_PACKAGES = ("ragged_dtensor", "dbuffer", "optim_blockwise", "fsdp_engine")


def _python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        check=False,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def fresh() -> dict[str, Any]:
    """One fresh interpreter (collective checks requested by the environment, so that the
    import's and the integration's handling of them is seen too)."""
    preload = _python(
        f"import sys, json; import {', '.join(_PACKAGES)}; "
        "print(json.dumps([m for m in sys.modules if m == 'torch' or m.startswith('torch.')]))",
        {},
    )
    env = {"RAGGED_TEST_PRELOAD": preload, "RAGGED_DTENSOR_DEBUG_COLLECTIVES": "1"}
    result: dict[str, Any] = json.loads(_python(_SCRIPT, env))
    return result


@pytest.mark.multiprocess
def test_importing_the_packages_changes_nothing_in_torch(fresh: dict[str, Any]) -> None:
    assert fresh["skipped preloads"] == []
    assert fresh["import: named targets changed"] == []
    assert fresh["import: torch attributes changed"] == []
    assert fresh["import: integration installed"] is False
    assert fresh["import: collective checks on"] is False  # the environment asks; not at import


@pytest.mark.multiprocess
def test_the_integration_changes_only_its_targets_and_removal_restores_them(
    fresh: dict[str, Any],
) -> None:
    modules = ("_redistribute", "_dispatch", "_api")
    assert fresh["installed: named targets changed"] == sorted(
        [
            *(f"DTensor.{name}" for name in ("__create_chunk_list__", "__create_write_items__")),
            "DTensor.__get_tensor_shard__",
            "DTensor.data_ptr",  # [Note: a DTensor's data_ptr]
            "_api globals",  # the trampoline's target
            "_api.distribute_tensor.__code__",  # [Note: distribute_tensor's code]
            "dispatch mode stack",  # the collective checks the environment asked for
            "dispatcher instance attributes",
            "dispatcher._dispatch_get_local_results_slow_path",
            "global optimizer post hooks",  # their step counter
            "propagator instance attributes",
            "propagator.propagate_op_sharding",
            "propagator.propagate_op_sharding_non_cached",
            *(f"torch.distributed.tensor.{m}.redistribute_local_tensor" for m in modules),
        ]
    )
    assert fresh["installed: parts"] == dict.fromkeys(
        ("redistribute", "propagator", "random", "checkpoint", "distribute_tensor", "data_ptr"),
        True,
    )
    assert fresh["installed: collective checks on"] is True
    assert fresh["removed: named targets changed"] == []
    assert fresh["removed: torch attributes changed"] == []
    assert fresh["removed: parts"] == dict.fromkeys(
        ("redistribute", "propagator", "random", "checkpoint", "distribute_tensor", "data_ptr"),
        False,
    )
    assert fresh["removed: collective checks on"] is False
    assert fresh["lazy: installed"] is True
    assert fresh["lazy removed: named targets changed"] == []


# -- in this process: refusals (each restores what it changed) -------------------------------------


@pytest.fixture
def integration_removed() -> Iterator[None]:
    """The integration removed for the test, put back afterwards if it was installed."""
    was = dtensor_integration_installed()
    uninstall_dtensor_integration()
    try:
        yield
    finally:
        if was:
            install_dtensor_integration()


def _wrapped(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return wrapper


def _targets() -> dict[str, tuple[Any, str, Any]]:
    """target name -> (owner, attribute, a replacement that is not torch's function)."""
    original = dtensor_redistribute.redistribute_local_tensor
    return {
        "torch.distributed.tensor._dispatch.redistribute_local_tensor": (
            dtensor_dispatch,
            "redistribute_local_tensor",
            _wrapped(original),  # functools.wraps keeps torch's name and module
        ),
        "torch.distributed.tensor._redistribute.redistribute_local_tensor": (
            dtensor_redistribute,
            "redistribute_local_tensor",
            _wrapped(original),
        ),
        "torch.distributed.tensor.DTensor.__create_write_items__": (
            DTensor,
            "__create_write_items__",
            _wrapped(DTensor.__create_write_items__),
        ),
        "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached": (
            DTensor._op_dispatcher.sharding_propagator,
            "propagate_op_sharding_non_cached",
            _wrapped(DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached),
        ),
        "DTensor._op_dispatcher._dispatch_get_local_results_slow_path": (
            DTensor._op_dispatcher,
            "_dispatch_get_local_results_slow_path",
            _wrapped(DTensor._op_dispatcher._dispatch_get_local_results_slow_path),
        ),
    }


def _state() -> dict[str, Any]:
    return {
        "redistribute": [
            m.redistribute_local_tensor
            for m in (dtensor_redistribute, dtensor_dispatch, dtensor_api)
        ],
        "checkpoint": [
            vars(DTensor)[n] for n in ("__create_write_items__", "__get_tensor_shard__")
        ],
        "propagator": dict(vars(DTensor._op_dispatcher.sharding_propagator)),
        "dispatcher": dict(vars(DTensor._op_dispatcher)),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
    return a is b


@pytest.mark.usefixtures("integration_removed")
@pytest.mark.parametrize("target", sorted(_targets()))
def test_install_refuses_a_target_that_is_not_torchs_function(
    target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner, name, replacement = _targets()[target]
    monkeypatch.setattr(owner, name, replacement, raising=False)
    before = _state()
    with pytest.raises(DTensorIntegrationError, match=rf"{target.replace('.', '[.]')} is not"):
        install_dtensor_integration()
    with pytest.raises(DTensorIntegrationError, match="Refusing to install"):
        RaggedShard((0,), (1, 1))  # the lazy install refuses the same way
    assert _same(_state(), before)  # nothing was changed
    assert not dtensor_integration_installed()
    monkeypatch.undo()
    with dtensor_integration():  # torch's own functions again: it installs
        assert all(hooks_installed().values())


@pytest.mark.usefixtures("integration_removed")
def test_install_refuses_another_torch_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "__version__", "2.14.0+cpu")
    with pytest.raises(
        DTensorIntegrationError, match=r"supports torch 2\.13\.x; found torch 2\.14"
    ):
        install_dtensor_integration()
    assert not any(hooks_installed().values())


@pytest.mark.usefixtures("integration_removed")
def test_removal_refuses_when_a_wrapper_was_replaced_since(monkeypatch: pytest.MonkeyPatch) -> None:
    install_dtensor_integration()
    ours = dtensor_dispatch.redistribute_local_tensor
    monkeypatch.setattr(dtensor_dispatch, "redistribute_local_tensor", _wrapped(ours))
    with pytest.raises(
        DTensorIntegrationError,
        match=r"torch[.]distributed[.]tensor[.]_dispatch[.]redistribute_local_tensor no longer",
    ):
        uninstall_dtensor_integration()
    assert dtensor_integration_installed()
    monkeypatch.undo()
    uninstall_dtensor_integration()
    assert (
        dtensor_dispatch.redistribute_local_tensor is dtensor_redistribute.redistribute_local_tensor
    )


# -- why the checkpoint protocol stays on the class; what torch's own functions do -----------------


class _LocalWithProtocol(torch.Tensor):
    """A local-tensor type that defines DCP's protocol, as torch's LocalShardsWrapper does."""

    def __create_chunk_list__(self) -> list[Any]:
        return []


def _op_results(rank: int, world: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world,))
    local = torch.ones(2, 3).as_subclass(_LocalWithProtocol)
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    assert type(dt._local_tensor) is _LocalWithProtocol
    results = {
        "zeros_like": torch.zeros_like(dt),
        "detach": dt.detach(),
        "mul": dt * 2,
    }
    return {name: type(out._local_tensor).__name__ for name, out in results.items()}


def test_op_results_hold_plain_local_tensors_so_the_checkpoint_protocol_stays_on_the_class() -> (
    None
):
    """DTensor hands the checkpoint protocol to its local tensor only when the local tensor's type
    defines it; op dispatch wraps every op's result around a plain tensor (torch 2.13), so an
    optimizer's ``zeros_like(param)`` state would lose the protocol. If torch ever keeps the
    local type, move the protocol onto the local tensor and drop the class wrappers."""
    for result in run_threaded(_op_results, 2):
        assert result == dict.fromkeys(result, "Tensor"), result


def _distribute_with_torch(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(8.0).view(4, 2)
    ours = distribute_tensor(full, mesh, [RaggedShard((0,), (1, 3))])
    theirs = torch_distribute_tensor(full, mesh, [RaggedShard((0,), (1, 3))])
    return {
        "same": torch.equal(ours.to_local(), theirs.to_local()),
        "placements": theirs.placements == ours.placements,
    }


def _refused_without(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    placement = RaggedShard((0,), (1,))
    uninstall_dtensor_integration()  # torch's own code again: it refuses the placement
    try:
        torch_distribute_tensor(torch.zeros(4, 2), mesh, [placement])
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        install_dtensor_integration()


def test_torchs_distribute_tensor_cuts_a_raggedshard_while_installed() -> None:
    """[Note: distribute_tensor's code]: the function object users bound at import keeps its
    identity; while the integration is installed it cuts a RaggedShard share (what FSDP2 users
    do to load full weights into sharded parameters), and without it torch's own code refuses
    the placement."""
    assert torch_distribute_tensor is dtensor_api.distribute_tensor
    for result in run_threaded(_distribute_with_torch, 2, timeout=60):
        assert result["same"] and result["placements"], result
    # one rank: the refusal comes before any collective, and no other rank races the removal
    (message,) = run_threaded(_refused_without, 1, timeout=60)
    assert "unsupported placements RS((0,), (1,))" in message, message
