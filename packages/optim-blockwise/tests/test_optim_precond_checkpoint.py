"""Shampoo / SOAP state through torch.distributed.checkpoint, across world sizes and layouts.

Same-arithmetic tests (one thread, same data): a run saved after 2 steps at one world size and
continued at another equals the uninterrupted single-device run bit for bit, because every
tile's statistics, roots / eigenbases and moments arrive whole at the tile's new owner.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from optim_precond_support import check_equal_to_single, make
from optim_support import local_of, ragged_spec, shard
from torch.distributed.device_mesh import init_device_mesh

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

SHAPES = [(40, 50), (7,), (33, 16)]
KWARGS: dict[str, dict[str, Any]] = {
    "shampoo": {
        "lr": 1e-2,
        "weight_decay": 0.1,
        "max_preconditioner_dim": 16,
        "precondition_frequency": 2,
        "start_preconditioning_step": 2,
    },
    "soap": {
        "lr": 1e-2,
        "weight_decay": 0.1,
        "max_preconditioner_dim": 16,
        "precondition_frequency": 2,
    },
}


def _data() -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in SHAPES]
    grads = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(4)]
    return fulls, grads


def _specs(world: int, how: str) -> list[tuple[Any, ...]]:
    if how == "chunk":
        return [("chunk",)] * len(SHAPES)
    return [ragged_spec(s, world, 1, seed=world * 5 + i) for i, s in enumerate(SHAPES)]


def _save(rank: int, world: int, kind: str, how: str, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    specs = _specs(world, how)
    fulls, grads = _data()
    params = [torch.nn.Parameter(shard(f, mesh, sp)) for f, sp in zip(fulls, specs, strict=True)]
    opt = make(kind, params, KWARGS[kind])
    for step in range(2):
        for p, g, sp in zip(params, grads[step], specs, strict=True):
            p.grad = shard(g, mesh, sp)
        opt.step()
    model = {f"p{i}": p for i, p in enumerate(params)}
    dcp.save({"model": model, "optim": opt.state_dict()}, checkpoint_id=path)


def _load_continue(rank: int, world: int, kind: str, how: str, path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    specs = _specs(world, how)
    _, grads = _data()
    params = [
        torch.nn.Parameter(shard(torch.zeros(s), mesh, sp))
        for s, sp in zip(SHAPES, specs, strict=True)
    ]
    opt = make(kind, params, KWARGS[kind])
    for p in params:  # materialize the state so that the template has every key
        p.grad = torch.zeros_like(p)
    opt.step()
    template = {"model": {f"p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict()}
    dcp.load(template, checkpoint_id=path)
    opt.load_state_dict(template["optim"])
    for step in range(2, 4):
        for p, g, sp in zip(params, grads[step], specs, strict=True):
            p.grad = shard(g, mesh, sp)
        opt.step()
    records = []
    for p in params:
        record = {"param": local_of(p.detach()).clone()}
        record.update({k: v.clone() for k, v in opt.state[p].items()})
        records.append(record)
    return {"records": records}


def _single(kind: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    fulls, grads = _data()
    params = [torch.nn.Parameter(f.clone()) for f in fulls]
    opt = make(kind, params, KWARGS[kind])
    for step in range(4):
        for p, g in zip(params, grads[step], strict=True):
            p.grad = g.clone()
        opt.step()
    records = []
    for p in params:
        record = {"param": p.detach().reshape(-1).clone()}
        record.update({k: v.clone() for k, v in opt.state[p].items()})
        records.append(record)
    return {"records": records}


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
@pytest.mark.parametrize(
    ("save_world", "save_how", "load_world", "load_how"),
    [(2, "ragged", 3, "ragged"), (4, "chunk", 2, "ragged")],
    ids=["ragged2-to-ragged3", "shard0-4-to-ragged2"],
)
def test_dcp_reshards_and_continues_like_one_device(
    kind: str, save_world: int, save_how: str, load_world: int, load_how: str, tmp_path: Any
) -> None:
    path = str(tmp_path / "ckpt")
    run_threaded(_save, save_world, kind, save_how, path, timeout=120)
    per_rank = run_threaded(_load_continue, load_world, kind, load_how, path, timeout=120)
    check_equal_to_single(per_rank, _single(kind), SHAPES, _specs(load_world, load_how))


def _torch_api_round_trip(rank: int, world: int, kind: str, path: str) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    specs = _specs(world, "ragged")
    fulls, grads = _data()

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        module = torch.nn.Module()
        for i, (f, sp) in enumerate(zip(fulls, specs, strict=True)):
            module.register_parameter(f"p{i}", torch.nn.Parameter(shard(f, mesh, sp)))
        return module, make(kind, list(module.parameters()), KWARGS[kind])

    def step(module: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
        for p, g, sp in zip(module.parameters(), grads[i], specs, strict=True):
            p.grad = shard(g, mesh, sp)
        opt.step()
        opt.zero_grad()

    model, opt = build()
    for i in range(2):
        step(model, opt, i)
    dcp.save({"optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    full = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    left, right = ("L", "R") if kind == "shampoo" else ("GG_L", "GG_R")
    assert tuple(full["state"]["p0"][f"block0_{left}"].shape) == (16, 16)
    assert tuple(full["state"]["p0"][f"block11_{right}"].shape) == (2, 2)
    assert tuple(full["state"]["p1"]["exp_avg"].shape) == (7,)
    model2, opt2 = build()
    with torch.no_grad():
        for p, q in zip(model.parameters(), model2.parameters(), strict=True):
            local_of(q).copy_(local_of(p))
    template = {"optim": get_optimizer_state_dict(model2, opt2)}  # torch steps once to init
    dcp.load(template, checkpoint_id=path)
    set_optimizer_state_dict(model2, opt2, template["optim"])
    for i in range(2, 4):
        step(model, opt, i)
        step(model2, opt2, i)
    same_state = all(
        torch.equal(opt.state[p][k], opt2.state[q][k])
        for p, q in zip(model.parameters(), model2.parameters(), strict=True)
        for k in opt.state[p]
    )
    same_params = all(
        torch.equal(local_of(p), local_of(q))
        for p, q in zip(model.parameters(), model2.parameters(), strict=True)
    )
    return same_state and same_params


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_torch_state_dict_api_round_trip(kind: str, tmp_path: Any) -> None:
    """``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` + DCP, and full state dicts
    that gather every block to its global shape."""
    out = run_threaded(_torch_api_round_trip, 2, kind, str(tmp_path / "ckpt"), timeout=120)
    assert out == [True, True]


def test_plain_state_dict_round_trip_continues_identically() -> None:
    fulls, grads = _data()
    for kind in ("shampoo", "soap"):
        params = [torch.nn.Parameter(f.clone()) for f in fulls]
        opt = make(kind, params, KWARGS[kind])
        for step in range(2):
            for p, g in zip(params, grads[step], strict=True):
                p.grad = g.clone()
            opt.step()
        clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
        opt2 = make(kind, clones, {**KWARGS[kind], "lr": 5.0})
        opt2.load_state_dict(opt.state_dict())
        assert opt2.param_groups[0]["lr"] == KWARGS[kind]["lr"]
        for step in range(2, 4):
            for p, q, g in zip(params, clones, grads[step], strict=True):
                p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            opt2.step()
        assert all(torch.equal(p, q) for p, q in zip(params, clones, strict=True)), kind
