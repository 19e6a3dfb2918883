"""Checkpoints off the training path (issue 28 item 1): torch's own code that stages or copies
a state dict works on the engine's state dict as on FSDP2's (the control, same model, same
steps): ``dcp.async_save``, the stagers of ``torch.distributed.checkpoint.staging``,
``_create_cpu_state_dict`` + ``_copy_state_dict``, ``get_state_dict(cpu_offload=True)``,
``copy.deepcopy``, ``torch.save``; and the ``new_*`` / ``*_like`` factories DCP and optimizers
call on a sharded parameter.

Before the fix every copy of the engine's state dict failed ("Attempted to call copy_() on an
invalid python storage"; ``dcp.async_save`` first on ``new_empty([])``): see [Note: a DTensor's
data_ptr] in ``checkpoint_staging``.

Numerics: copies and checkpoints move bits; the engines train the same arithmetic (bitwise
FSDP2's, ``test_engine_training_parity``): bitwise.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from engine_models import TinyLlama
from engine_reliability_common import assert_bitwise_equal, build, full_snapshot, train
from engine_training import initial_state
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import (
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate

from ragged_dtensor.testing import run_processes, run_threaded

pytestmark = pytest.mark.numerics

ENGINES = ("fsdp2", "ours")


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flat(item, f"{prefix}{key}."))
        return out
    if isinstance(value, list):
        return {f"{prefix}{i}": item for i, item in enumerate(value)}
    return {prefix.rstrip("."): value}


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr() if tensor.numel() else -1


def _compare(original: Any, copied: Any, *, aliases: bool) -> str:
    """'' when ``copied`` holds ``original``'s structure, placements and values (bitwise), its
    tensors in storage of their own (``aliases=False``) or the original's (``True``)."""
    a, b = _flat(original), _flat(copied)
    if sorted(a) != sorted(b):
        return f"keys differ: {sorted(set(a) ^ set(b))}"
    for key, x in a.items():
        y = b[key]
        if not isinstance(x, torch.Tensor):
            if x != y:
                return f"{key}: {x!r} became {y!r}"
            continue
        if type(y) is not type(x):
            return f"{key}: a {type(x).__name__} became a {type(y).__name__}"
        mine, theirs = x, y
        if isinstance(x, DTensor):
            if (x.placements, x.shape) != (y.placements, y.shape):
                return f"{key}: {x.placements} {x.shape} became {y.placements} {y.shape}"
            mine, theirs = x._local_tensor, y._local_tensor
        if theirs.device.type != "cpu" or not torch.equal(mine, theirs):
            return f"{key}: values differ"
        if mine.numel() and (_storage(mine) == _storage(theirs)) != aliases:
            return f"{key}: {'does not share' if aliases else 'shares'} the original's storage"
    return ""


def test_state_dict_dtensors_hold_storage_of_their_own_elements_like_fsdp2s() -> None:
    """The engine's sharded parameters live in one flat storage per group; each one's local
    tensor is over a storage of its own elements (a slice of the flat one, no copy), at offset
    0, as each of FSDP2's owns its storage: its DTensor reports ``data_ptr() == 0`` with
    nothing of torch changed ([Note: DTensors over views] in the engine's compat), and saves and
    copies of it see its own elements only."""

    def body(rank: int, world: int, engine: str) -> dict[str, Any]:
        model, opt = build(world, engine=engine)
        train(model, opt, rank, world, start=0, steps=1)
        model_sd, _ = get_state_dict(model, opt)
        locals_ = [v._local_tensor for v in model_sd.values()]
        return {
            "offsets": sorted({t.storage_offset() for t in locals_}),
            "wrapper data_ptr": sorted({v.data_ptr() for v in model_sd.values()}),
            "locals have data": all(t.data_ptr() != 0 for t in locals_ if t.numel()),
            "storage holds more than the local": [
                k
                for k, t in zip(model_sd, locals_, strict=True)
                if t.untyped_storage().nbytes() > 2 * max(1, t.numel()) * t.element_size()
            ],
            "data_ptr patched": "data_ptr" in vars(DTensor),
        }

    fsdp2, ours = (run_threaded(body, 2, engine, timeout=120)[0] for engine in ENGINES)
    assert fsdp2["offsets"] == [0] and fsdp2["wrapper data_ptr"] == [0], fsdp2
    assert fsdp2["locals have data"] and not fsdp2["data_ptr patched"], fsdp2
    assert ours == {**fsdp2, "storage holds more than the local": []}, ours


def _saved_and_loaded(state_dict: dict[str, Any]) -> Any:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


_COPIES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "DefaultStager (dcp.async_save's)": lambda sd: DefaultStager(
        StagingOptions(False, False, False, False)
    ).stage(sd),
    "DefaultStager, shared memory": lambda sd: DefaultStager(
        StagingOptions(False, True, False, False)
    ).stage(sd),
    "BlockingAsyncStager": lambda sd: BlockingAsyncStager().stage(sd),
    "_create_cpu_state_dict + _copy_state_dict": lambda sd: _copy_state_dict(
        sd, _create_cpu_state_dict(sd)
    ),
    "_create_cpu_state_dict(share_memory=True)": lambda sd: _copy_state_dict(
        sd, _create_cpu_state_dict(sd, share_memory=True)
    ),
    "copy.deepcopy": copy.deepcopy,
    "torch.save / torch.load": _saved_and_loaded,
}


def _copies(rank: int, world: int, engine: str) -> dict[str, str]:
    model, opt = build(world, engine=engine)
    train(model, opt, rank, world, start=0, steps=1)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    outcome: dict[str, str] = {}
    copies: dict[str, Any] = {}
    for name, make in _COPIES.items():
        try:
            copies[name] = make(state)
        except Exception as exc:
            outcome[name] = f"{type(exc).__name__}: {exc}"
            continue
        outcome[name] = _compare(state, copies[name], aliases=False) or "copied"
    # the copies are copies: a training step later, each still holds the old values
    before = full_snapshot(model, opt)
    train(model, opt, rank, world, start=1, steps=1)
    for name, copied in copies.items():
        held = {}
        for key, value in _flat(copied).items():
            if isinstance(value, DTensor):
                held[key] = value.full_tensor()
        changed = [k for k in held if k in before and not torch.equal(held[k], before[k])]
        if changed and outcome[name] == "copied":
            outcome[name] = f"changed with training: {changed[:3]}"
    # cpu_offload: on a CPU mesh the tensors already are on the CPU, so torch hands back the
    # same storage (FSDP2's too); the values and placements are the state's
    offload_model, offload_optim = get_state_dict(
        model, opt, options=StateDictOptions(cpu_offload=True)
    )
    model_sd, optim_sd = get_state_dict(model, opt)
    outcome["get_state_dict(cpu_offload=True)"] = (
        _compare(
            {"model": model_sd, "optim": optim_sd},
            {"model": offload_model, "optim": offload_optim},
            aliases=True,
        )
        or "copied"
    )
    fulls = {key: value.full_tensor() for key, value in model_sd.items()}
    full_model, _ = get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        same = sorted(full_model) == sorted(fulls) and all(
            type(full_model[k]) is torch.Tensor and torch.equal(full_model[k], v)
            for k, v in fulls.items()
        )
        outcome["full_state_dict + cpu_offload"] = "copied" if same else "differs"
    return outcome


def test_dcp_staging_and_copies_work_on_our_state_dict_like_fsdp2s() -> None:
    fsdp2, ours = (run_threaded(_copies, 2, engine, timeout=240)[0] for engine in ENGINES)
    assert fsdp2 == ours, {"fsdp2": fsdp2, "ours": ours}
    assert set(ours.values()) == {"copied"}, ours
    assert len(ours) == len(_COPIES) + 2


# -- factories on a sharded parameter: FSDP2's Shard(0) parameter is the control -----------------

_FACTORIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "new_empty([], device='cpu') (DCP's stager)": lambda p: p.new_empty([], device="cpu"),
    "new_zeros(row_shape) (Adafactor)": lambda p: p.new_zeros((*p.shape[:-1], 1)),
    "new_zeros([3])": lambda p: p.new_zeros([3]),
    "new_ones([2, 2], float64)": lambda p: p.new_ones([2, 2], dtype=torch.float64),
    "new_full([4], 7.0)": lambda p: p.new_full([4], 7.0),
    "new_empty_strided([2, 3], [1, 2])": lambda p: p.new_empty_strided([2, 3], [1, 2]),
    "new_zeros(p.shape)": lambda p: p.new_zeros(p.shape),
    "new_full(p.shape, 2.0)": lambda p: p.new_full(p.shape, 2.0),
    "new_empty(p.shape)": lambda p: p.new_empty(p.shape),
    "zeros_like(preserve_format) (Adam, SGD, ...)": lambda p: torch.zeros_like(
        p, memory_format=torch.preserve_format
    ),
    "full_like(0.5) (Adagrad)": lambda p: torch.full_like(p, 0.5),
    "empty_like(device='cpu')": lambda p: torch.empty_like(p, device="cpu"),
    "ones_like": torch.ones_like,
}


def _factories(rank: int, world: int, engine: str) -> dict[str, Any]:
    model, _ = build(world, engine=engine)
    param = model.layers[0].qkv.weight  # sharded on every rank in both engines
    out: dict[str, Any] = {}
    for name, make in _FACTORIES.items():
        made = make(param)
        assert isinstance(made, DTensor), name
        kind = "replicate" if made.placements == (Replicate(),) else "as the parameter"
        if kind == "as the parameter":
            assert made.placements == param.placements, name
            assert made.to_local().shape == param.to_local().shape, name
        value = None
        if not name.startswith(("new_empty", "empty_like")):
            value = made.full_tensor()
        out[name] = (kind, tuple(made.shape), made.dtype, value)
    out["placement"] = type(param.placements[0]).__name__
    return out


def test_new_and_like_factories_on_a_sharded_parameter_match_fsdp2() -> None:
    """Same shape: the parameter's placement and local shape; another shape: Replicate (torch's
    rule for Shard(0), which RaggedShard follows since the ragged-dtensor fix); the values of
    the initialised ones equal FSDP2's."""
    fsdp2, ours = (run_threaded(_factories, 2, engine, timeout=120)[0] for engine in ENGINES)
    assert (fsdp2.pop("placement"), ours.pop("placement")) == ("Shard", "RaggedShard")
    for name in _FACTORIES:
        (kind, shape, dtype, value), theirs = ours[name], fsdp2[name]
        assert (kind, shape, dtype) == theirs[:3], (name, ours[name][:3], theirs[:3])
        if value is not None:
            assert torch.equal(value, theirs[3]), name


_OPTIMIZERS = ("Adagrad", "RMSprop", "ASGD", "NAdam", "RAdam", "Adamax", "SGD")


def _optimizer_run(rank: int, world: int, engine: str, name: str) -> Any:
    model, _ = build(world, engine=engine)
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
    try:
        train(model, opt, rank, world, start=0, steps=2)
    except Exception as exc:
        first = str(exc).splitlines()[0]
        return f"{type(exc).__name__}: {first[:60]}"
    return full_snapshot(model, opt)


def _plain_optimizer_run(rank: int, world: int, name: str) -> dict[str, torch.Tensor]:
    """One process, no sharding: the reference."""
    model = TinyLlama()
    model.load_state_dict(initial_state())
    opt = getattr(torch.optim, name)(model.parameters(), lr=1e-2)
    train(model, opt, rank, world, start=0, steps=2)
    return full_snapshot(model, opt)


@pytest.mark.parametrize("name", [*_OPTIMIZERS, "Adafactor"])
def test_torch_optimizers_that_make_state_with_factories_match_fsdp2(name: str) -> None:
    """The state each optimizer makes (``zeros_like``, ``full_like``, Adafactor's
    ``grad.new_zeros(row_shape)``) and its steps: bitwise FSDP2's. Adafactor fails on FSDP2 at
    ``pow_`` of a sharded norm (DTensor refuses the in-place op on a ``Partial``); on ours the
    ragged reduction is reduced first, and its parameters equal one process's within the
    reordered sums' rounding (fp32, two steps: rtol 1e-5 is ~100 eps of headroom over the
    few-eps difference of a norm summed in two halves)."""
    # ours first: see the xfail test below for a failed FSDP2 Adafactor step before ours
    ours, fsdp2 = (
        run_threaded(_optimizer_run, 2, e, name, timeout=120)[0] for e in ("ours", "fsdp2")
    )
    if name == "Adafactor":
        # FSDP2 alone refuses at pow_; once ragged_dtensor's integration is installed in the
        # process (ours ran), its reduce-first rule for in-place ops on a Partial applies to
        # FSDP2's DTensors too, and FSDP2's step must then be right as well
        assert isinstance(ours, dict), ours
        plain = run_threaded(_plain_optimizer_run, 1, name, timeout=120)[0]
        runs = [ours] if isinstance(fsdp2, str) else [ours, fsdp2]
        for key, value in plain.items():
            for run in runs:
                if not key.startswith("model."):
                    continue
                torch.testing.assert_close(
                    run[key], value, rtol=1e-5, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}"
                )
        return
    assert_bitwise_equal(ours, fsdp2)


def _fsdp2_then_ours_adafactor(rank: int, world: int) -> tuple[Any, Any]:
    fsdp2 = _optimizer_run(rank, world, "fsdp2", "Adafactor")
    return fsdp2, _optimizer_run(rank, world, "ours", "Adafactor")


@pytest.mark.xfail(
    strict=True,
    reason="open bug: after torch's FSDP2 fails an Adafactor step (pow_ on a Partial) in the "
    "same process, ragged_dtensor's slow-path hook is no longer reached for the in-place op on "
    "a Partial, so its write-back is skipped and ours is 5e-3 off one process (ours alone, or "
    "after FSDP2 SGD, is right)",
)
def test_adafactor_after_a_failed_fsdp2_adafactor_step_in_the_same_process() -> None:
    # fresh processes: the state this leaves behind must not reach the other tests' workers
    fsdp2, ours = run_processes(_fsdp2_then_ours_adafactor, 2, timeout=300)[0]
    assert isinstance(fsdp2, str) and "aten.pow_.Scalar" in fsdp2, fsdp2
    plain = run_threaded(_plain_optimizer_run, 1, "Adafactor", timeout=120)[0]
    for key, value in plain.items():
        if key.startswith("model."):
            torch.testing.assert_close(ours[key], value, rtol=1e-5, atol=1e-7)


# -- dcp.async_save in processes (a CPU backend): round trip at 2, load at 1 and 3 ---------------


def _dcp_async_save(rank: int, world: int, root: str) -> dict[str, Any]:
    """Each engine trains 2 steps, ``dcp.async_save``s (on a gloo group of its own, as DCP asks:
    its thread's collectives must not interleave with training's) and trains a third step
    before waiting: the checkpoint holds the state at the call."""
    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")
    out: dict[str, Any] = {}
    for engine in ENGINES:
        model, opt = build(world, engine=engine)
        train(model, opt, rank, world, start=0, steps=2)
        out[engine] = full_snapshot(model, opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        future = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=f"{root}/{engine}",
            process_group=group,
        )
        train(model, opt, rank, world, start=2, steps=1)  # the parameters change at once
        future.result()
    return out if rank == 0 else {}


def _dcp_load(rank: int, world: int, root: str, name: str, engine: str) -> dict[str, Any]:
    model, opt = build(world, engine=engine)
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=f"{root}/{name}")
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return full_snapshot(model, opt)


@pytest.mark.multiprocess
def test_dcp_async_save_round_trips_bitwise_at_2_and_loads_at_1_and_3(tmp_path: Path) -> None:
    """``dcp.async_save`` of ``get_state_dict(model, opt)``: the script that works on FSDP2
    works on ours; each checkpoint loads into either engine at world sizes 1 and 3 with the
    values at the call (parameters and AdamW state), bitwise."""
    saved = run_processes(_dcp_async_save, 2, str(tmp_path), timeout=240)[0]
    assert_bitwise_equal(saved["ours"], saved["fsdp2"])  # the same training
    for name in ENGINES:
        for world in (1, 3):
            for got in run_threaded(_dcp_load, world, str(tmp_path), name, "ours", timeout=120):
                assert_bitwise_equal(got, saved[name])
    for got in run_threaded(_dcp_load, 3, str(tmp_path), "ours", "fsdp2", timeout=120):
        assert_bitwise_equal(got, saved["ours"])
