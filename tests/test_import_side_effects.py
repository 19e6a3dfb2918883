"""Importing our packages changes nothing in torch (issue 27); ragged-dtensor's DTensor
integration, installed by the first RaggedShard (or explicitly), changes only its targets and its
removal puts torch's very objects back.

The checks run in fresh interpreters, so that the import order is real: torch first, then
``ragged_dtensor``, ``dbuffer``, ``optim_blockwise``, ``fsdp_engine``. They live here, not in
ragged-dtensor's tests, because they import every package (each package's test session installs
only what it declares).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

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
    import torch.distributed._state_dict_utils as state_dict_utils

    out["_state_dict_utils._distribute_tensors"] = state_dict_utils._distribute_tensors
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
    for op, handler in dispatcher._custom_op_handlers.items():
        out[f"dispatcher._custom_op_handlers[{op}]"] = handler
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
            "_api globals",  # the trampoline's target
            "_api.distribute_tensor.__code__",  # [Note: distribute_tensor's code]
            "_state_dict_utils._distribute_tensors",  # the full-state-dict load from rank 0
            "dispatch mode stack",  # the collective checks the environment asked for
            "dispatcher instance attributes",
            "dispatcher._dispatch_get_local_results_slow_path",
            # [Note: ops DTensor handles by hand]
            *(
                f"dispatcher._custom_op_handlers[aten.{op}]"
                for op in (
                    "argmax.default",
                    "argmin.default",
                    "as_strided.default",
                    "convolution.default",
                    "convolution_backward.default",
                )
            ),
            "global optimizer post hooks",  # their step counter
            "propagator instance attributes",
            "propagator.propagate_op_sharding",
            "propagator.propagate_op_sharding_non_cached",
            *(f"torch.distributed.tensor.{m}.redistribute_local_tensor" for m in modules),
        ]
    )
    assert fresh["installed: parts"] == dict.fromkeys(
        (
            "redistribute",
            "propagator",
            "random",
            "checkpoint",
            "distribute_tensor",
            "state_dict",
            "custom_handlers",
        ),
        True,
    )
    assert fresh["installed: collective checks on"] is True
    assert fresh["removed: named targets changed"] == []
    assert fresh["removed: torch attributes changed"] == []
    assert fresh["removed: parts"] == dict.fromkeys(
        (
            "redistribute",
            "propagator",
            "random",
            "checkpoint",
            "distribute_tensor",
            "state_dict",
            "custom_handlers",
        ),
        False,
    )
    assert fresh["removed: collective checks on"] is False
    assert fresh["lazy: installed"] is True
    assert fresh["lazy removed: named targets changed"] == []
