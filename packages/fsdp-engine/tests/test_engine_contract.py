"""FSDP2's public contract (torch 2.13's ``torch.distributed.fsdp`` and ``_fully_shard``), row by
row of the README's "FSDP2's contract" table, with torch's FSDP2 as the control wherever it runs
on CPU (threaded process group unless a row needs processes).

Numeric kind of every value comparison here: *same arithmetic* (same kernels on the same
unsharded values, one thread per rank, a two-rank mean is a two-term sum times 1/2): bitwise.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import (
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

import fsdp_engine
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
    offsets = sorted({p.to_local().storage_offset() for p in model.parameters()})  # type: ignore[attr-defined]
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
    storage: "invalid python storage", [Note: the per-rank save])."""
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
