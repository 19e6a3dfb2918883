"""Optimizer state through torch.distributed.checkpoint (DCP): save, load, continue identically.

Numerics: a reloaded run against an uninterrupted one is the same arithmetic: bitwise.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from optim_support import UNALIGNED, local_of, make_optimizer, ragged_spec, shard
from torch.distributed.device_mesh import init_device_mesh

from ragged_dtensor.testing import DistributedFailure, run_threaded

pytestmark = [pytest.mark.numerics, pytest.mark.filterwarnings(UNALIGNED)]

SHAPES = [(64, 96), (33,), (100, 48)]


def _specs(world: int, how: str) -> list[tuple[Any, ...]]:
    if how == "chunk":
        return [("chunk",)] * len(SHAPES)
    unit = 256 if how == "aligned" else 1
    return [
        ragged_spec(s, world, unit if math.prod(s) % unit == 0 else 1, seed=i)
        for i, s in enumerate(SHAPES)
    ]


def _save_load_continue(rank: int, world: int, kind: str, how: str, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init_device_mesh("cpu", (world,))
    specs = _specs(world, how)
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(4)]
    kwargs: dict[str, Any] = {"lr": 0.01}
    if kind == "adamw8bit":
        kwargs["min_8bit_size"] = 1024

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        module = torch.nn.Module()
        for i, (f, sp) in enumerate(zip(fulls, specs, strict=True)):
            module.register_parameter(f"p{i}", torch.nn.Parameter(shard(f, mesh, sp)))
        return module, make_optimizer(kind, list(module.parameters()), kwargs)

    def step(module: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        for p, g, sp in zip(module.parameters(), grads[i], specs, strict=True):
            p.grad = shard(g, mesh, sp)
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for i in range(2):
        step(model, opt, i)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    model2, opt2 = build()
    with torch.no_grad():
        for p, q in zip(model.parameters(), model2.parameters(), strict=True):
            local_of(q).copy_(local_of(p))
    template = {"optim": get_optimizer_state_dict(model2, opt2)}
    dcp.load(template, checkpoint_id=path)
    set_optimizer_state_dict(model2, opt2, template["optim"])
    for key in opt.state[next(iter(model.parameters()))]:
        a = opt.state[next(iter(model.parameters()))][key]
        b = opt2.state[next(iter(model2.parameters()))][key]
        assert a.dtype == b.dtype and torch.equal(a, b), key
    for i in range(2, 4):
        step(model, opt, i)
        step(model2, opt2, i)
    return all(
        torch.equal(local_of(p), local_of(q))
        for p, q in zip(model.parameters(), model2.parameters(), strict=True)
    )


@pytest.mark.parametrize(
    ("kind", "how"),
    [
        ("adamw8bit", "aligned"),
        ("adamw8bit", "elementwise"),
        ("adamw8bit", "chunk"),
        ("muon", "elementwise"),
        ("muon", "chunk"),
    ],
)
def test_dcp_round_trip_continues_bit_identically(kind: str, how: str, tmp_path: Any) -> None:
    out = run_threaded(_save_load_continue, 2, kind, how, str(tmp_path / "ckpt"), timeout=120)
    assert out == [True, True]


def _kwargs(kind: str) -> dict[str, Any]:
    return {"lr": 0.01, "min_8bit_size": 1024} if kind == "adamw8bit" else {"lr": 0.01}


def _aligned_specs(shapes: list[tuple[int, ...]], world: int) -> list[tuple[Any, ...]]:
    return [
        ragged_spec(s, world, 256 if math.prod(s) % 256 == 0 else 1, seed=i)
        for i, s in enumerate(shapes)
    ]


def _two_steps(
    mesh: Any, world: int, kind: str, shapes: list[tuple[int, ...]]
) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    specs = _aligned_specs(shapes, world)
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(2)]
    params = [torch.nn.Parameter(shard(f, mesh, sp)) for f, sp in zip(fulls, specs, strict=True)]
    opt = make_optimizer(kind, params, _kwargs(kind))
    for i in range(2):
        for p, g, sp in zip(params, grads[i], specs, strict=True):
            p.grad = shard(g, mesh, sp)
        opt.step()
    return params, opt


def _save_only(rank: int, world: int, kind: str, path: str, shapes: list[tuple[int, ...]]) -> None:
    import torch.distributed.checkpoint as dcp

    _, opt = _two_steps(init_device_mesh("cpu", (world,)), world, kind, shapes)
    dcp.save({"optim": opt.state_dict()}, checkpoint_id=path)


def _load_only(
    rank: int, world: int, kind: str, path: str, shapes: list[tuple[int, ...]]
) -> list[dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world,))
    specs = _aligned_specs(shapes, world)
    params = [
        torch.nn.Parameter(shard(torch.zeros(s), mesh, sp))
        for s, sp in zip(shapes, specs, strict=True)
    ]
    opt = make_optimizer(kind, params, _kwargs(kind))
    for p in params:  # materialize the state so that the template has its shapes
        p.grad = torch.zeros_like(p)
    opt.step()
    template = {"optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=path)
    opt.load_state_dict(template["optim"])
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params]


@pytest.mark.parametrize("kind", ["adamw8bit", "muon"])
def test_dcp_reshards_state_from_two_to_three_ranks(kind: str, tmp_path: Any) -> None:
    """Saved at world size 2, loaded at 3 (block-aligned layouts): every rank holds exactly the
    single-device state's slice for its new range."""
    from optim_support import check_against_single

    shapes = [(64, 96), (33,), (64, 64)]  # 8-bit ones are whole 256-blocks: aligned layouts
    path = str(tmp_path / "ckpt")
    run_threaded(_save_only, 2, kind, path, shapes, timeout=120)
    loaded = run_threaded(_load_only, 3, kind, path, shapes, timeout=120)
    params, opt = _two_steps(None, 1, kind, shapes)
    single = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    check_against_single(loaded, single, shapes, _aligned_specs(shapes, 3), 256)


def test_dcp_refuses_to_reshard_absmaxes_of_unaligned_shards(tmp_path: Any) -> None:
    """With a shard boundary inside a quantization block the saved absmax vector depends on
    the layout: loading into another layout fails with DCP's error naming the key."""
    shapes = [(100, 48)]  # 4800 elements: a ragged last block, element-granular shards
    path = str(tmp_path / "ckpt")
    run_threaded(_save_only, 2, "adamw8bit", path, shapes, timeout=120)
    with pytest.raises(DistributedFailure, match="exp_avg_absmax"):
        run_threaded(_load_only, 3, "adamw8bit", path, shapes, timeout=120)


def _full(rank: int, world: int, kind: str) -> str:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    mesh = init_device_mesh("cpu", (world,))
    module = torch.nn.Module()
    for i, s in enumerate(SHAPES):
        spec = ragged_spec(s, world, 1, seed=i)
        module.register_parameter(f"p{i}", torch.nn.Parameter(shard(torch.randn(s), mesh, spec)))
    opt = make_optimizer(
        kind, list(module.parameters()), {"ns_dtype": torch.float32} if kind == "muon" else {}
    )
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    full = get_optimizer_state_dict(module, opt, options=StateDictOptions(full_state_dict=True))
    first = full["state"]["p0"]
    key = "momentum_buffer" if kind == "muon" else "exp_avg_codes"
    return f"{tuple(first[key].shape)} {full['param_groups'][0].get('ns_dtype')}"


@pytest.mark.parametrize("kind", ["muon", "adamw8bit"])
def test_full_state_dict_gathers_whole_tensors(kind: str) -> None:
    """``full_state_dict=True`` gathers every state tensor to its global shape (``ns_dtype`` is
    kept by name in the param groups: torch's gather accepts no ``torch.dtype`` there)."""
    out = run_threaded(_full, 2, kind, timeout=120)
    want = "(64, 96) float32" if kind == "muon" else "(64, 96) None"
    assert out == [want, want]


def test_ns_dtype_must_be_a_floating_dtype() -> None:
    import optim_blockwise as ob

    p = torch.nn.Parameter(torch.zeros(4, 4))
    assert ob.Muon([p], ns_dtype="float32").param_groups[0]["ns_dtype"] == "float32"
    with pytest.raises(ValueError, match="ns_dtype"):
        ob.Muon([p], ns_dtype=torch.int32)
