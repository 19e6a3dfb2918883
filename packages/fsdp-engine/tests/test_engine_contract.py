"""FSDP2's public contract (torch 2.13's ``torch.distributed.fsdp`` and ``_fully_shard``), row by
row of the README's "FSDP2's contract" table, with torch's FSDP2 as the control wherever it runs
on CPU (threaded process group unless a row needs processes).

Numeric kind of every value comparison here: *same arithmetic* (same kernels on the same
unsharded values, one thread per rank, a two-rank mean is a two-term sum times 1/2): bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import (
    ALL_GATHER,
    REDUCE_SCATTER,
    Mlp,
    Stack,
    counting,
    data,
    engine,
    full_grads,
    full_params,
    make,
    shard_stack,
)
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import fsdp_engine
from ragged_dtensor import storage_base
from ragged_dtensor.testing import free_port, run_threaded

ENGINES = ["ours", "fsdp2"]


# -- isinstance(m, torch.distributed.fsdp.FSDPModule) ---------------------------------------------
def _is_torch_fsdp_module(rank: int, world: int) -> Any:
    model = make(Stack)
    shard_stack(fsdp_engine, model)
    modules = [model, *model.blocks]
    handle = model.blocks[0].unshard(async_op=True)  # type: ignore[operator]
    assert handle is not None
    handle.wait()
    model.blocks[0].reshard()  # type: ignore[operator]
    return (
        [isinstance(m, torch_fsdp.FSDPModule) for m in modules],
        [isinstance(m, fsdp_engine.FSDPModule) for m in modules],
        [type(m).__mro__[1:4] for m in modules],
        isinstance(handle, torch_fsdp.UnshardHandle),
        isinstance(model.proj, torch_fsdp.FSDPModule),  # a plain submodule stays plain
    )


def test_our_modules_are_torchs_fsdp_modules_with_our_class_first() -> None:
    """Trainers check ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (torchtitan's
    gradient-division switch, Lightning Fabric's no-sync toggle): true for every module
    ``fsdp_engine.fully_shard`` was applied to, and ``fsdp_engine.FSDPModule`` stays first in
    the MRO (ours, torch's, then the original class); an unshard handle is torch's too."""
    theirs, ours, mros, handle_is_torchs, plain = run_threaded(_is_torch_fsdp_module, 2)[0]
    assert all(theirs) and all(ours)
    assert mros[0] == (fsdp_engine.FSDPModule, torch_fsdp.FSDPModule, Stack)
    assert all(mro == (fsdp_engine.FSDPModule, torch_fsdp.FSDPModule, Mlp) for mro in mros[1:])
    assert handle_is_torchs and not plain


_NOT_METHODS = {"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"}


def _methods(cls: type) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(cls).items()
        if name not in _NOT_METHODS
        and (callable(value) or isinstance(value, (staticmethod, classmethod, property)))
    }


def test_every_method_of_torchs_fsdp_module_is_overridden_by_ours() -> None:
    """None of torch's FSDPModule methods (they reach for torch's private per-module state) is
    ever run on our modules: ours defines every one torch's defines, public and private, so this
    fails the day torch adds one we do not override. Each keeps torch's parameter names and
    defaults (ours may add keyword-only ones)."""
    torchs = _methods(torch_fsdp.FSDPModule)
    ours = _methods(fsdp_engine.FSDPModule)
    missing = sorted(set(torchs) - set(ours))
    assert not missing, f"torch's FSDPModule methods fsdp_engine does not override: {missing}"
    assert {"reshard", "unshard", "set_requires_gradient_sync", "_get_fsdp_state"} <= set(torchs)
    for name, theirs in torchs.items():
        if name == "__new__" or not inspect.isfunction(theirs):
            continue
        want = inspect.signature(theirs).parameters
        got = inspect.signature(ours[name]).parameters
        for param in want.values():
            assert param.name in got, (name, param.name)
            mine = got[param.name]
            assert (mine.kind, mine.default) == (param.kind, param.default), (name, param.name)
    for name in torchs:  # the generated class finds ours first
        fsdp_cls = type("FSDPLinear", (fsdp_engine.FSDPModule, nn.Linear), {})
        assert inspect.getattr_static(fsdp_cls, name) is inspect.getattr_static(
            fsdp_engine.FSDPModule, name
        ), name


def _trainer_style(rank: int, world: int, impl: str) -> Any:
    """What trainers do with the modules that pass ``isinstance``: torchtitan turns off the
    division (``set_gradient_divide_factor(1.0)``, with ``set_force_sum_reduction_for_comms``
    on backends without a pre-multiplied sum), Fabric's no-sync toggles gradient sync."""
    torch.set_num_threads(1)
    model = make(Stack)
    shard_stack(engine(impl), model)
    fsdp_modules = [m for m in model.modules() if isinstance(m, torch_fsdp.FSDPModule)]
    for m in fsdp_modules:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # the threaded group has no PREMUL_SUM
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    with counting() as no_sync:
        model(data(rank, 0)).sum().backward()
    for m in fsdp_modules:
        m.set_requires_gradient_sync(True, recurse=False)
    with counting() as synced:
        model(data(rank, 1)).sum().backward()
    return (
        len(fsdp_modules),
        no_sync.get(REDUCE_SCATTER, 0),
        synced[REDUCE_SCATTER],
        full_grads(model),
    )


def test_trainers_isinstance_checks_reach_our_setters_like_fsdp2s() -> None:
    """Code written against torch's class finds our modules and its setters act as on FSDP2's:
    no reduce-scatter while sync is off, the sum (divide factor 1) of both microbatches after."""
    ours = run_threaded(_trainer_style, 2, "ours")
    theirs = run_threaded(_trainer_style, 2, "fsdp2")
    for (n1, off1, on1, g1), (n2, off2, on2, g2) in zip(ours, theirs, strict=True):
        assert (n1, off1) == (n2, off2) == (3, 0)
        assert on1 == on2 == 3
        for name, grad in g2.items():
            assert torch.equal(g1[name], grad), name  # type: ignore[arg-type]


class _Features(Mlp):
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = _Features()
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.vision.features(x))  # not the submodule's ``forward``


def _torch_forward_method(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    out = []
    for register in (
        torch_fsdp.register_fsdp_forward_method,
        fsdp_engine.register_fsdp_forward_method,
    ):
        model = make(_Tower)
        fsdp_engine.fully_shard(model.vision)
        fsdp_engine.fully_shard(model)
        register(model.vision, "features")
        loss = model(data(rank)).sum()
        loss.backward()
        out.append((loss.detach(), full_grads(model)))
    return out


def test_torchs_register_fsdp_forward_method_works_on_our_modules() -> None:
    """``torch.distributed.fsdp.register_fsdp_forward_method`` (what libraries import) applied
    to our module unshards around the method like ours does: it asks the module for its state
    (``_get_fsdp_state``), and ours has FSDP2's ``_pre_forward``/``_post_forward``."""
    for (l1, g1), (l2, g2) in run_threaded(_torch_forward_method, 2):
        assert torch.equal(l1, l2)
        for name, grad in g2.items():
            assert torch.equal(g1[name], grad), name  # type: ignore[arg-type]


# -- FSDP2's trace: debug log lines and profiler ranges -------------------------------------------
_FSDP_LOGGER = "torch.distributed.fsdp.fully_shard"


class _ThreadRecords(logging.Handler):
    """The FSDP debug lines this thread (rank) logs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.thread = threading.get_ident()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.lines.append(record.getMessage())


class _Chunked(nn.Module):
    """The root runs ``norm`` only; the ``[norm, head]`` group's ``head`` runs per chunk after
    forward (FSDP2's chunked-loss case: its post-forward is completed by the root)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = Mlp()
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x))


def _debug_lines(rank: int, world: int, impl: str) -> list[str]:
    torch.set_num_threads(1)
    api = engine(impl)
    handler = _ThreadRecords()
    logger = logging.getLogger(_FSDP_LOGGER)
    logger.addHandler(handler)
    try:
        model = make(Stack)
        shard_stack(api, model)
        for step in range(2):
            model(data(rank, step)).sum().backward()
        with torch.no_grad():
            model(data(rank, 2))
        chunked = make(_Chunked)
        api.fully_shard(chunked.body)
        api.fully_shard([chunked.norm, chunked.head])
        api.fully_shard(chunked)
        hidden = chunked(data(rank))
        sum(chunked.head(part).sum() for part in hidden.chunk(2)).backward()
    finally:
        logger.removeHandler(handler)
    return handler.lines


def test_fsdp2s_debug_lines_are_ours_line_for_line() -> None:
    """FSDP2 logs each step of each module (``FSDP::pre_forward (blocks.0)``...) at DEBUG on
    ``torch.distributed.fsdp.fully_shard``; ours logs the same lines on the same logger, in the
    same order: training steps, a no-grad forward, a ``fully_shard([norm, head])`` group whose
    forward the root completes (``FSDP::force_complete_post_forward``)."""
    logger = logging.getLogger(_FSDP_LOGGER)
    level = logger.level
    logger.setLevel(logging.DEBUG)
    try:
        ours = run_threaded(_debug_lines, 2, "ours")
        theirs = run_threaded(_debug_lines, 2, "fsdp2")
    finally:
        logger.setLevel(level)
    assert theirs[0] == theirs[1]
    assert "FSDP::force_complete_post_forward" in theirs[0]
    assert "FSDP::pre_backward (blocks.1)" in theirs[0]
    assert ours == theirs


# One process (no torch.distributed yet) for what needs a fresh interpreter: fully_shard
# initializing the default group from the environment, and TORCH_LOGS read at torch's import.
_FRESH_SCRIPT = """
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from engine_fsdp2 import Stack, make, shard_stack, data
import torch.distributed.fsdp as torch_fsdp
import fsdp_engine
report = {{}}
for name, api in (("fsdp2", torch_fsdp), ("ours", fsdp_engine)):
    env = {{k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE")}}
    try:  # no RANK in the environment: init_process_group's own error
        api.fully_shard(make(Stack))
    except Exception as exc:
        report[name + " without RANK"] = type(exc).__name__ + ": " + str(exc)
    os.environ.update(env)
    before = dist.is_initialized()
    model = make(Stack)
    shard_stack(api, model)  # no mesh=: the default one
    print("=== " + name, file=sys.stderr, flush=True)
    model(data(0)).sum().backward()
    print("=== end", file=sys.stderr, flush=True)
    report[name] = [before, dist.is_initialized(), dist.get_world_size(),
                    model.proj.weight.device_mesh.device_type]
    dist.destroy_process_group()
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def fresh_process() -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TORCH_LOGS": "+fsdp",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    script = _FRESH_SCRIPT.format(tests=str(Path(__file__).parent))
    done = subprocess.run(
        [sys.executable, "-c", script],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_fully_shard_initializes_the_default_group_from_the_environment_like_fsdp2(
    fresh_process: subprocess.CompletedProcess[str],
) -> None:
    """Without ``mesh=`` and before ``torch.distributed`` is initialized, FSDP2 calls
    ``init_process_group()`` (the environment's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...)
    and shards over the default mesh; so does ours. Without ``RANK``, both raise
    ``init_process_group``'s own error naming the variable."""
    report = json.loads(fresh_process.stdout.strip().splitlines()[-1])
    assert report["ours"] == report["fsdp2"] == [False, True, 1, "cpu"], report
    assert report["ours without RANK"] == report["fsdp2 without RANK"], report
    assert "RANK" in report["ours without RANK"], report


def test_torch_logs_fsdp_prints_our_lines_like_fsdp2s(
    fresh_process: subprocess.CompletedProcess[str],
) -> None:
    """``TORCH_LOGS=+fsdp`` (torch's registered ``fsdp`` log at DEBUG) prints our lines as it
    prints FSDP2's: the same messages, ours naming our source file."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in fresh_process.stderr.splitlines():
        if line.startswith("=== "):
            current = line[4:]
            sections[current] = []
        elif current is not None and "] FSDP::" in line:
            where, message = line.split("] ", 1)
            sections[current].append((where, message))
    theirs = [message for _, message in sections["fsdp2"]]
    ours = [message for _, message in sections["ours"]]
    assert len(theirs) == 14, theirs
    assert ours == theirs
    assert all("fsdp_engine/_private/state.py" in where for where, _ in sections["ours"])


def _ranges(rank: int, world: int, impl: str) -> set[str]:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    shard_stack(api, model, mp_policy=api.MixedPrecisionPolicy(param_dtype=torch.float64))
    model(data(rank, 0)).sum().backward()  # the second iteration has a forward order
    if rank != 0:  # one profiler per process: rank 0's
        model(data(rank, 1)).sum().backward()
        return set()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(data(rank, 1)).sum().backward()
    return {e.name for e in prof.events() if e.name.startswith("FSDP::")}


def test_fsdp2s_profiler_ranges_are_ours() -> None:
    """The profiler shows FSDP2's ranges under FSDP2's names (``FSDP::pre_forward (blocks.0)``,
    ``FSDP::all_gather``, ``FSDP::post_backward_reduce``, ``FSDP::backward_prefetch for ...``,
    the casts, the waits for reductions in flight...), except the steps the engine does not
    have: the copy out of the all-gather buffer and the unsharded-gradient accumulation (the
    all-gather writes the parameters' storage and autograd accumulates into the reduce-scatter
    input); ours adds the implicit forward prefetch's."""
    ours = run_threaded(_ranges, 2, "ours")[0]
    theirs = run_threaded(_ranges, 2, "fsdp2")[0]
    base = {name.split(" (")[0].split(" for ")[0] for name in theirs - ours}
    assert base == {"FSDP::all_gather_copy_out", "FSDP::post_backward_accumulate"}, theirs - ours
    assert {name.split(" for ")[0] for name in ours - theirs} == {"FSDP::forward_prefetch"}
    assert {"FSDP::cast_forward_inputs", "FSDP::post_backward_rs_wait (blocks.0)"} <= ours


# -- fully_shard's module argument and the module's class -----------------------------------------
def _module_errors(rank: int, world: int, impl: str) -> dict[str, str]:
    api = engine(impl)
    other = engine("fsdp2" if impl == "ours" else "ours")
    out: dict[str, str] = {}

    def capture(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"

    sharded = make(Mlp)
    api.fully_shard(sharded)
    capture("deepcopy", lambda: copy.deepcopy(sharded))
    parent = nn.Sequential(make(Mlp))
    api.fully_shard(parent[0])
    capture("deepcopy of a parent", lambda: copy.deepcopy(parent))
    capture("applied twice", lambda: api.fully_shard(sharded))
    by_other = make(Mlp)
    other.fully_shard(by_other)
    capture("applied over the other engine's", lambda: api.fully_shard(by_other))
    capture("ModuleList", lambda: api.fully_shard(nn.ModuleList([nn.Linear(2, 2)])))
    capture("ModuleDict", lambda: api.fully_shard(nn.ModuleDict({"a": nn.Linear(2, 2)})))
    twice = make(Mlp)
    capture("same module twice in a list", lambda: api.fully_shard([twice.up, twice.up]))
    out["state"] = type(api.fully_shard.state(sharded)).__name__
    out["state of a plain module"] = repr(api.fully_shard.state(nn.Linear(2, 2)))
    return out


def test_module_argument_errors_and_deepcopy_match_fsdp2() -> None:
    """FSDP2's contract for the module: ``copy.deepcopy`` raises its ``AssertionError`` (the
    copy would share or lose the sharded storage), also through a parent; ``fully_shard`` on a
    module it was applied to, by either engine, its ``AssertionError`` ("already been
    applied"; ours says by whom); a ``ModuleList``/``ModuleDict`` (no ``forward``: the hooks
    would never run) its ``ValueError``; ``fully_shard.state(module)`` the call's state, or
    None."""
    ours = run_threaded(_module_errors, 2, "ours")[0]
    theirs = run_threaded(_module_errors, 2, "fsdp2")[0]
    deepcopy_error = "AssertionError: FSDP does not support deepcopy. Please use state dict"
    applied = (
        "AssertionError: Each distinct composable distributed API can only be applied to a "
        "module once"
    )
    container = "ValueError: fully_shard does not support containers that do not implement forward"
    for out in (ours, theirs):
        assert out["deepcopy"].startswith(deepcopy_error), out
        assert out["deepcopy of a parent"].startswith(deepcopy_error), out
        for name in ("applied twice", "applied over the other engine's"):
            assert out[name].startswith(applied) and "already been applied" in out[name], out
        assert out["ModuleList"].startswith(container), out
        assert out["ModuleDict"].startswith(container), out
        assert out["same module twice in a list"].startswith(applied), out
        assert out["state of a plain module"] == "None", out
    assert "(by fsdp_engine.fully_shard)" in ours["applied twice"]
    assert "(by torch.distributed.fsdp.fully_shard)" in ours["applied over the other engine's"]
    assert (ours["state"], theirs["state"]) == ("FSDPState", "FSDPState")


# -- what users do with the sharded model ---------------------------------------------------------
def _per_rank_save(rank: int, world: int, impl: str, folder: str) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    shard_stack(api, model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(data(rank, step)).sum().backward()
        optim.step()
        optim.zero_grad()
    path = Path(folder) / f"{impl}_rank{rank}.pt"
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, path)
    # where each local tensor starts in the storage its memory belongs to (ours: the flat shard)
    offsets = sorted({storage_base(p.to_local())[1] for p in model.parameters()})  # type: ignore[attr-defined]
    fresh = make(Stack, seed=1)
    shard_stack(api, fresh)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    saved = torch.load(path)  # weights_only=True, torch's default
    fresh.load_state_dict(saved["model"])
    fresh_optim.load_state_dict(saved["optim"])
    same = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(model.parameters(), fresh.parameters(), strict=True)  # type: ignore[attr-defined]
    )
    losses = []
    for m, o in ((model, optim), (fresh, fresh_optim)):
        loss = m(data(rank, 2)).sum()
        loss.backward()
        o.step()
        losses.append(loss.detach())
    return offsets, same, losses, full_params(fresh)


def test_the_plain_per_rank_torch_save_round_trips_bitwise_like_fsdp2(tmp_path: Path) -> None:
    """``torch.save(model.state_dict())`` on each rank (and the optimizer's), ``torch.load``
    (``weights_only=True``) and ``load_state_dict`` at the same world size: the parameters come
    back bit for bit and training continues as if uninterrupted, like FSDP2; also for the
    parameters that start inside a rank's flat shard (torch's DTensor took that offset for a
    storage: "invalid python storage", [Note: the per-rank save]; their local tensors are now
    over storage slices of their own, [Note: DTensors over views])."""
    for impl in ENGINES:
        for offsets, same, (before, after), _ in run_threaded(
            _per_rank_save, 2, impl, str(tmp_path)
        ):
            assert same, impl
            assert torch.equal(before, after), impl
            if impl == "ours":
                assert offsets[-1] > 0, offsets  # some parameter starts inside the shard
    ours = run_threaded(_per_rank_save, 2, "ours", str(tmp_path))[0][3]
    theirs = run_threaded(_per_rank_save, 2, "fsdp2", str(tmp_path))[0][3]
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def _clipped(rank: int, world: int, order: float) -> Any:
    torch.set_num_threads(1)
    model = make(lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2), nn.Linear(2, 1)))
    fsdp_engine.fully_shard(model)
    model(data(rank)).sum().backward()
    empty = [p.grad.to_local().numel() == 0 for p in model.parameters()]  # type: ignore[union-attr]
    grads = {n: g.clone() for n, g in full_grads(model).items() if g is not None}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=order)
    # one process on the same gradients
    reference = [g.clone() for g in grads.values()]
    params = [nn.Parameter(torch.empty_like(g)) for g in reference]
    for p, g in zip(params, reference, strict=True):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(params, 0.5, norm_type=order)
    return any(empty), total.full_tensor(), want, full_grads(model), [p.grad for p in params]


def test_clip_grad_norm_of_every_order_works_where_a_rank_holds_no_element() -> None:
    """``clip_grad_norm_(..., norm_type=inf)`` when a rank holds no element of some parameter
    (common in our layout): torch's kernel refuses an empty tensor (FSDP2 fails the same way
    on an empty ``Shard(0)`` share, on those ranks only, and the others then wait in the next
    collective); ours gives one process's norm and clipped gradients on every rank, for every
    order (inf, -inf and 0 exactly; p-norms within the summation-order rounding)."""
    for order in (float("inf"), float("-inf"), 0.0, 1.0, 2.0):
        for has_empty, total, want, grads, clipped in run_threaded(_clipped, 4, order):
            assert has_empty
            exact = order in (float("inf"), float("-inf"), 0.0)
            if exact:
                assert torch.equal(total, want), (order, total, want)
            torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
            for got, ref in zip(grads.values(), clipped, strict=True):
                torch.testing.assert_close(got, ref, rtol=0 if exact else 1e-6, atol=0)


# -- FSDPModule's setters that trainers and pipelining call ---------------------------------------
def _microbatches(rank: int, world: int, impl: str, pipelined: bool) -> Any:
    """Two microbatches then one synced: with ``pipelined``, the steps torch's pipelining
    schedules do around a stage's backward (``set_is_last_backward(False)``,
    ``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``, all set back
    for the last one)."""
    torch.set_num_threads(1)
    model = make(Stack)
    shard_stack(engine(impl), model)
    counts: list[dict[str, int]] = []
    registered: list[bool] = []
    for micro in range(3):
        last = micro == 2
        if pipelined:
            model.set_is_last_backward(last)  # type: ignore[operator]
            model.set_reshard_after_backward(last)  # type: ignore[operator]
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        with counting() as count:
            model(data(rank, micro)).sum().backward()
        counts.append(dict(count))
        registered.append(isinstance(model.blocks[0].up.weight, DTensor))
    return counts, registered, full_grads(model)


def test_pipelining_setters_keep_parameters_unsharded_and_gradients_like_fsdp2() -> None:
    """``set_reshard_after_backward(False)`` leaves the parameters unsharded after backward (the
    next forward gathers nothing: 2 all-gathers, the blocks' re-gathers in backward, instead of
    5), ``set_is_last_backward(False)`` defers the end of backward to the last microbatch, and
    the gradients equal plain accumulation; the same collectives as FSDP2's, microbatch by
    microbatch."""
    for impl in ENGINES:
        plain = run_threaded(_microbatches, 2, impl, False)
        piped = run_threaded(_microbatches, 2, impl, True)
        for (_, _, want), (counts, registered, got) in zip(plain, piped, strict=True):
            assert registered == [False, False, True], (impl, registered)
            assert [c.get(ALL_GATHER, 0) for c in counts] == [5, 2, 2], (impl, counts)
            assert [c.get(REDUCE_SCATTER, 0) for c in counts] == [0, 0, 3], (impl, counts)
            for name, grad in want.items():
                assert torch.equal(got[name], grad), (impl, name)  # type: ignore[arg-type]
    ours = run_threaded(_microbatches, 2, "ours", True)[0][0]
    theirs = run_threaded(_microbatches, 2, "fsdp2", True)[0][0]
    assert ours == theirs, (ours, theirs)


@contextlib.contextmanager
def _reduce_ops() -> Iterator[list[str]]:
    """The reduce op of every reduce-scatter, whichever engine issues it."""
    seen: list[str] = []
    original = dist.reduce_scatter_single

    def record(*args: Any, **kwargs: Any) -> Any:
        op = kwargs.get("op", args[2] if len(args) > 2 else dist.ReduceOp.SUM)
        seen.append(str(op).rsplit(".", 1)[-1])
        return original(*args, **kwargs)

    dist.reduce_scatter_single = record
    try:
        yield seen
    finally:
        dist.reduce_scatter_single = original


def _force_sum(rank: int, world: int, impl: str, force: bool) -> Any:
    torch.set_num_threads(1)
    model = make(Mlp)
    engine(impl).fully_shard(model)
    model.set_force_sum_reduction_for_comms(force)  # type: ignore[operator]
    model(data(rank)).sum().backward()
    return full_grads(model)


def test_set_force_sum_reduction_for_comms_uses_sum_and_gives_fsdp2s_gradients() -> None:
    """``set_force_sum_reduction_for_comms(True)``: the reduce-scatter is a SUM, the mean's
    division runs outside it, and the gradients are FSDP2's (bitwise: a two-rank sum times
    1/2)."""
    results = {}
    for impl in ENGINES:
        for force in (False, True):
            with _reduce_ops() as ops:
                results[impl, force] = run_threaded(_force_sum, 2, impl, force)[0]
            if force:
                assert ops and set(ops) == {"SUM"}, (impl, ops)
    for key, grads in results.items():
        for name, grad in results["fsdp2", False].items():
            assert torch.equal(grads[name], grad), (key, name)  # type: ignore[arg-type]


def _hints(rank: int, world: int, impl: str) -> dict[str, str]:
    api = engine(impl)
    out: dict[str, str] = {}

    def capture(name: str, fn: Any) -> None:
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "; ".join(f"{w.category.__name__}: {w.message}" for w in caught) or "ok"

    model = make(Mlp)
    api.fully_shard(model)
    capture("divide factor (old name)", lambda: model.set_reduce_scatter_divide_factor(2.0))  # type: ignore[operator]
    capture("separate group off", lambda: model.set_separate_reduce_scatter_group(False))  # type: ignore[operator]
    capture("max input buffers True", lambda: model.set_reduce_scatter_max_input_buffers(True))  # type: ignore[operator]
    capture("max input buffers 0", lambda: model.set_reduce_scatter_max_input_buffers(0))  # type: ignore[operator]
    custom = make(Mlp)
    api.fully_shard(custom)
    custom.set_custom_all_gather(object())  # type: ignore[operator]
    capture("symm mem with a custom all-gather", custom.set_symm_mem_for_comm)  # type: ignore[operator]
    capture("reset_iter_state on a non-root", lambda: _non_root_reset(api))
    capture(
        "reshard_after_forward of another type",
        lambda: api.fully_shard(Mlp(), reshard_after_forward="yes"),
    )
    if impl == "ours":
        capture("symm mem", model.set_symm_mem_for_comm)  # type: ignore[operator]
    return out


def _non_root_reset(api: Any) -> None:
    model = make(Stack)
    shard_stack(api, model)
    model(data(0)).sum().backward()
    model.blocks[0].reset_iter_state()  # type: ignore[operator]


def test_hints_deprecations_and_refusals_match_fsdp2() -> None:
    """``set_reduce_scatter_divide_factor`` warns that it is deprecated; turning the separate
    reduce-scatter group off is accepted; ``set_reduce_scatter_max_input_buffers`` refuses a
    bool and a non-positive count with FSDP2's errors; ``set_symm_mem_for_comm`` refuses a custom
    collective; ``reset_iter_state`` on a non-root and a ``reshard_after_forward`` of another
    type raise FSDP2's exception types. ``set_symm_mem_for_comm()`` itself raises in FSDP2 on
    CPU (no NCCL) and allocates NCCL staging buffers on CUDA; ours has no staging buffers
    (each all-gather writes the planned persistent storage): accepted, no effect."""
    ours = run_threaded(_hints, 2, "ours")[0]
    theirs = run_threaded(_hints, 2, "fsdp2")[0]
    for out in (ours, theirs):
        assert out["divide factor (old name)"].startswith("DeprecationWarning: Use"), out
        assert out["separate group off"] == "ok", out
        assert (
            out["max input buffers True"] == "TypeError: max_input_buffers must be an int, got bool"
        )
        assert out["max input buffers 0"] == (
            "ValueError: max_input_buffers must be a positive int, got 0"
        )
        assert out["symm mem with a custom all-gather"].startswith(
            "AssertionError: cannot call set_symm_mem() when all gather comm is custom"
        ), out
        assert out["reset_iter_state on a non-root"].startswith(
            "RuntimeError: reset_iter_state must be called on the root FSDP module"
        ), out
        assert out["reshard_after_forward of another type"].startswith(
            "ValueError: reshard_after_forward should be a bool or an int"
        ), out
    assert ours["symm mem"] == "ok", ours


# -- public names, signatures, policies ---------------------------------------------------------
def test_fsdp2s_public_names_and_fully_shard_signature_are_ours() -> None:
    """Every FSDP2 name of ``torch.distributed.fsdp.__all__`` is in ``fsdp_engine``
    (``DataParallelMeshDims`` is FSDP2's own class); ``fully_shard`` takes FSDP2's
    arguments with FSDP2's names, kinds and defaults (ours adds keyword-only ones) and has
    ``fully_shard.state``."""
    fsdp2_names = {
        "CPUOffloadPolicy",
        "DataParallelMeshDims",
        "FSDPModule",
        "fully_shard",
        "MixedPrecisionPolicy",
        "OffloadPolicy",
        "register_fsdp_forward_method",
        "UnshardHandle",
        "share_comm_ctx",
    }
    assert fsdp2_names <= set(torch_fsdp.__all__)
    assert fsdp2_names <= set(fsdp_engine.__all__)
    assert fsdp_engine.DataParallelMeshDims is torch_fsdp.DataParallelMeshDims
    theirs = inspect.signature(torch_fsdp.fully_shard).parameters
    ours = inspect.signature(fsdp_engine.fully_shard).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    for name, param in theirs.items():
        mine = ours[name]
        assert mine.kind == param.kind, name
        if isinstance(param.default, (torch_fsdp.MixedPrecisionPolicy, torch_fsdp.OffloadPolicy)):
            assert dataclasses.asdict(mine.default) | dataclasses.asdict(
                param.default
            ) == dataclasses.asdict(mine.default), name
            assert isinstance(mine.default, type(param.default)), name
        else:
            assert mine.default == param.default, name
    assert all(p.kind is p.KEYWORD_ONLY for n, p in ours.items() if n not in theirs)
    assert callable(fsdp_engine.fully_shard.state)  # type: ignore[attr-defined]


def test_policies_are_fsdp2s_dataclasses_with_its_fields_and_defaults() -> None:
    """``MixedPrecisionPolicy`` (frozen), ``OffloadPolicy`` and ``CPUOffloadPolicy`` are
    dataclasses subclassing FSDP2's: its fields, defaults and frozen-ness (ours adds
    ``quantized_all_gather``), ``dataclasses.replace`` works, ``isinstance`` against torch's
    holds, and ``fully_shard`` takes torch's own policies too."""
    pairs = [
        (fsdp_engine.MixedPrecisionPolicy, torch_fsdp.MixedPrecisionPolicy),
        (fsdp_engine.OffloadPolicy, torch_fsdp.OffloadPolicy),
        (fsdp_engine.CPUOffloadPolicy, torch_fsdp.CPUOffloadPolicy),
    ]
    for ours, theirs in pairs:
        assert issubclass(ours, theirs) and dataclasses.is_dataclass(ours)
        want = {f.name: f.default for f in dataclasses.fields(theirs)}
        got = {f.name: f.default for f in dataclasses.fields(ours)}
        assert {k: got[k] for k in want} == want, ours
        assert ours.__dataclass_params__.frozen == theirs.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert issubclass(fsdp_engine.CPUOffloadPolicy, fsdp_engine.OffloadPolicy)
    policy = fsdp_engine.MixedPrecisionPolicy(torch.bfloat16)
    changed = dataclasses.replace(policy, reduce_dtype=torch.float32)
    assert (changed.param_dtype, changed.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert [f.name for f in dataclasses.fields(policy)][-1] == "quantized_all_gather"


def _torch_policies(rank: int, world: int, impl: str) -> Any:
    torch.set_num_threads(1)
    model = make(Stack)
    shard_stack(
        engine(impl),
        model,
        mp_policy=torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.float64),
        offload_policy=torch_fsdp.CPUOffloadPolicy(pin_memory=False),
    )
    model(data(rank)).sum().backward()
    return full_grads(model)


def test_fully_shard_takes_torchs_policy_objects_like_fsdp2() -> None:
    ours = run_threaded(_torch_policies, 2, "ours")[0]
    theirs = run_threaded(_torch_policies, 2, "fsdp2")[0]
    for name, grad in theirs.items():
        assert torch.equal(ours[name], grad), name  # type: ignore[arg-type]


def _returned_and_sliced(rank: int, world: int, impl: str) -> Any:
    api = engine(impl)
    pair = [make(Mlp), make(Mlp)]
    returned = api.fully_shard(pair)
    seq = make(lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    same = api.fully_shard(seq)
    tail = seq[1:]  # nn.Sequential slicing builds type(self)(...): FSDPModule.__new__
    return (
        returned is pair,
        same is seq,
        type(tail) is nn.Sequential,
        isinstance(tail, torch_fsdp.FSDPModule),
        len(tail),
    )


def test_fully_shard_returns_its_argument_and_slicing_builds_the_original_class() -> None:
    """``fully_shard`` returns the module, or the very list it was given; slicing a sharded
    ``nn.Sequential`` builds a plain ``nn.Sequential`` of the same children (FSDP2's
    ``FSDPModule.__new__``), not a fully_shard module."""
    ours = run_threaded(_returned_and_sliced, 2, "ours")[0]
    theirs = run_threaded(_returned_and_sliced, 2, "fsdp2")[0]
    assert ours == theirs == (True, True, True, False, 2)


class _ViewOut(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).view(-1)


def _warnings(rank: int, world: int, impl: str) -> None:
    api = engine(impl)
    model = make(_ViewOut)
    api.fully_shard(model)
    model(data(rank)).sum().backward()
    if world == 1:  # one thread: "once" is then deterministic for both engines
        api.fully_shard(make(Mlp), reshard_after_forward=1)


class _AllRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_fsdp2s_warnings_and_warning_log_lines_are_ours() -> None:
    """A module whose output is a view gets FSDP2's warning (an in-place op on it would drop
    the pre-backward hook); ``reshard_after_forward=1`` FSDP2's warning on its logger, once per
    process."""
    from fsdp_engine._private.trace import warning_once

    lines = {}
    for impl in ENGINES:
        torch._logging.warning_once.cache_clear()  # type: ignore[attr-defined]  # "once" per test
        warning_once.cache_clear()  # type: ignore[attr-defined]
        handler = _AllRecords()
        logging.getLogger(_FSDP_LOGGER).addHandler(handler)
        try:  # the warnings module's state is per process: caught here for both ranks
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run_threaded(_warnings, 2, impl)
                run_threaded(_warnings, 1, impl)
        finally:
            logging.getLogger(_FSDP_LOGGER).removeHandler(handler)
        views = [str(w.message)[:60] for w in caught if w.category is UserWarning]
        assert views == ["FSDP2-wrapped module (FSDP_ViewOut) returned a view tensor. "] * 3
        lines[impl] = handler.lines
    assert (
        lines["ours"]
        == lines["fsdp2"]
        == [
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, instead of "
            "reshard_after_forward=True (bool)"
        ]
    )


# -- FSDP2's layout one argument away ---------------------------------------------------------
def _row_indexing(rank: int, world: int, impl: str, placed: bool) -> Any:
    torch.set_num_threads(1)
    model = make(Mlp)
    kwargs: dict[str, Any] = {"shard_placement_fn": lambda p: Shard(0)} if placed else {}
    engine(impl).fully_shard(model, **kwargs)
    model(data(rank)).sum().backward()
    grad = model.up.weight.grad
    assert isinstance(grad, DTensor)
    local = grad._local_tensor
    try:
        first = local[0, 0].clone()  # what a GradScaler test does
    except IndexError as exc:
        first = f"IndexError: {exc}"
    return grad.placements, tuple(local.shape), first


def test_local_shards_are_flat_and_shard0_gives_fsdp2s_row_layout() -> None:
    """Our local shards are 1-D ranges (``RaggedShard``, by design: the README's "FSDP2's
    contract"), so ``p.grad._local_tensor[0, 0]`` fails; ``shard_placement_fn=lambda p:
    Shard(0)`` gives FSDP2's ``Shard(0)`` layout, its local shapes and values."""
    flat = run_threaded(_row_indexing, 2, "ours", False)
    assert all(len(shape) == 1 for _, shape, _ in flat)
    assert all(isinstance(first, str) and "IndexError" in first for _, _, first in flat)
    placed = run_threaded(_row_indexing, 2, "ours", True)
    theirs = run_threaded(_row_indexing, 2, "fsdp2", False)
    for (p1, s1, f1), (p2, s2, f2) in zip(placed, theirs, strict=True):
        assert p1 == p2 == (Shard(0),)
        assert s1 == s2 == (6, 8)
        assert torch.equal(f1, f2)


# -- what fully_shard refuses where FSDP2 goes on ----------------------------------------------
def _per_parameter_mesh(rank: int, world: int, impl: str) -> str:
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )

    mesh = init_device_mesh("cpu", (world,))
    info = FSDPMeshInfo(mesh, shard_mesh_dim=0)
    model = make(Mlp)
    try:
        engine(impl).fully_shard(
            model, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info)
        )
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return str([p.placements for p in model.parameters()])


def test_a_placement_result_on_the_calls_own_mesh_is_accepted_like_fsdp2() -> None:
    """``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult`` on the call's own mesh
    is its placement there (other meshes: ``test_engine_param_meshes.py``)."""
    theirs = run_threaded(_per_parameter_mesh, 2, "fsdp2")[0]
    ours = run_threaded(_per_parameter_mesh, 2, "ours")[0]
    assert ours == theirs == str([(Shard(0),)] * 4), (ours, theirs)


def test_parameters_on_another_device_than_the_mesh_are_refused_by_name() -> None:
    """FSDP2 moves the managed parameters and buffers to the mesh's device (a model built on
    the CPU, a CUDA mesh); ours raises ``ValueError`` naming the parameter and asking for the
    move (or meta init). The rule is the pure ``choose_device``; this machine has no
    accelerator to run both engines on."""
    from fsdp_engine._private.init import choose_device

    with pytest.raises(ValueError, match=r"'up.weight' is on cpu but the mesh is cuda"):
        choose_device({torch.device("cpu"): "up.weight"}, "cuda")
    assert choose_device({torch.device("cpu"): "up.weight"}, "cpu") == torch.device("cpu")


def _lazy_init_errors(rank: int, world: int, impl: str) -> dict[str, str]:
    api = engine(impl)
    out: dict[str, str] = {}

    def capture(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"

    grouped = make(Stack)
    api.fully_shard(list(grouped.blocks))
    capture("a group of modules runs forward first", lambda: grouped.blocks[0](data(rank)))
    child_first = make(Stack)
    shard_stack(api, child_first)
    child_first.blocks[0](data(rank))  # the block becomes a root of its own
    capture("the root after a child ran alone", lambda: child_first(data(rank)))
    with torch.device("meta"):
        on_meta = nn.Sequential(Mlp(), Mlp())
    for block in on_meta:
        api.fully_shard(block)
    api.fully_shard(on_meta)
    capture("a forward on meta parameters", lambda: on_meta(data(rank)))
    return out


def test_lazy_init_errors_match_fsdp2() -> None:
    """The first module to run forward becomes the root: a ``fully_shard([a, b])`` group cannot
    be one ("FSDP requires a single root module"), and a root whose child already ran forward
    alone raises "... has already been lazily initialized" (both RuntimeError, as FSDP2); a
    forward on meta parameters raises FSDP2's message word for word (the first group with meta
    parameters, and how to materialize them)."""
    ours = run_threaded(_lazy_init_errors, 2, "ours")[0]
    theirs = run_threaded(_lazy_init_errors, 2, "fsdp2")[0]
    # the first group (modules() order) with meta parameters, named from the root: FSDP2's text
    assert ours["a forward on meta parameters"] == theirs["a forward on meta parameters"]
    assert (
        "['0.up.weight', '0.up.bias', '0.down.weight', '0.down.bias']\nFor example"
        in (ours["a forward on meta parameters"])
    )
    for out in (ours, theirs):
        assert out["a group of modules runs forward first"].startswith(
            "RuntimeError: FSDP requires a single root module"
        ), out
        root_after = out["the root after a child ran alone"]
        assert root_after.startswith("RuntimeError:") and "already been lazily initialized" in (
            root_after
        ), out


def test_every_row_of_the_readme_contract_table_names_a_test_that_exists() -> None:
    """The README's "FSDP2's contract" section: each table row's last cell names at least one
    test, and every test it names exists in this repository's test files."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    section = readme.split("## FSDP2's contract", 1)[1].split("\n## ", 1)[0]
    sources = "".join(
        path.read_text() for path in Path(__file__).parents[2].glob("*/tests/test_*.py")
    )
    defined = set(re.findall(r"^def (test_\w+)", sources, flags=re.MULTILINE))
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line]
    rows = [row for row in rows if not row.startswith("| FSDP2 |")]
    assert len(rows) >= 60, len(rows)
    for row in rows:
        named = re.findall(r"\b(test_\w+)\b", row.rstrip(" |").rsplit(" | ", 1)[-1])
        named = [n for n in named if not n.startswith(("test_engine_", "test_ragged_"))]
        assert named, row
        missing = [n for n in named if n not in defined]
        assert not missing, (missing, row)
