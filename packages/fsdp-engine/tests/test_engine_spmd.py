"""``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(...))`` on a full SPMD mesh, and tensor
parallelism combined with HSDP, with torch's FSDP2 as the control.

Numerics: the same arithmetic (both engines compute with the same unsharded DTensors and reduce
the same local gradients over the same data-parallel groups), compared bitwise: losses and
trained parameters.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_fsdp2 import engine, make
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import fsdp_engine
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics
STEPS = 3


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(12, 40)
        self.down = nn.Linear(40, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mlp() for _ in range(2))
        self.norm = nn.LayerNorm(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.norm(x)


# the tensor-parallel placement of each parameter on the "tp" dim (Replicate otherwise)
_TP = {"up.weight": Shard(0), "up.bias": Shard(0), "down.weight": Shard(1)}


def _on_spmd_mesh(model: nn.Module, mesh: Any) -> None:
    """Every parameter a DTensor on the full mesh: Replicate on the data-parallel dims."""
    dp_dims = mesh.ndim - 1
    for name, param in list(model.named_parameters()):
        owner_name, attr = name.rsplit(".", 1)
        key = f"{owner_name.rsplit('.', 1)[-1]}.{attr}"
        placements = [Replicate()] * dp_dims + [_TP.get(key, Replicate())]
        value = distribute_tensor(param.detach(), mesh, placements)
        model.get_submodule(owner_name).register_parameter(attr, nn.Parameter(value))


def _train_spmd(
    rank: int, world: int, impl: str, names: tuple[str, ...], dims: dict[str, Any]
) -> dict[str, Any]:
    api = engine(impl)
    shape = (2,) * len(names)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = make(Net)
    _on_spmd_mesh(model, mesh)
    kwargs = {"mesh": mesh, "dp_mesh_dims": api.DataParallelMeshDims(**dims)}
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp_rank = rank // 2  # the tp dim is the last one: consecutive ranks share a batch
    gen = torch.Generator().manual_seed(dp_rank)
    dp_placements = [Shard(0)] * (len(names) - 1) + [Replicate()]
    losses = []
    for _ in range(STEPS):
        x = DTensor.from_local(torch.randn(4, 12, generator=gen), mesh, dp_placements)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.full_tensor().item())
    weight = model.blocks[0].up.weight
    assert isinstance(weight, DTensor)
    return {
        "losses": losses,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},  # type: ignore[operator]
        "mesh": weight.device_mesh.mesh_dim_names,
        "placements": weight.placements,
    }


def _compare(world: int, fn: Any, *args: Any) -> list[dict[str, Any]]:
    ours = run_threaded(fn, world, "ours", *args, timeout=300)
    theirs = run_threaded(fn, world, "fsdp2", *args, timeout=300)
    for mine, control in zip(ours, theirs, strict=True):
        assert mine["losses"] == control["losses"]
        for name, value in control["params"].items():
            assert torch.equal(mine["params"][name], value), name
        assert mine["mesh"] == control["mesh"]
    return ours


@pytest.mark.parametrize(
    ("names", "dims"),
    [
        (("dp", "tp"), {"shard": "dp"}),
        pytest.param(
            ("replicate", "shard", "tp"),
            {"shard": "shard", "replicate": "replicate"},
            marks=pytest.mark.slow,
        ),
        pytest.param(("dp", "cp", "tp"), {"shard": ("dp", "cp")}, marks=pytest.mark.slow),
    ],
    ids=["fsdp", "hsdp", "flattened"],
)
def test_dp_mesh_dims_trains_bitwise_like_fsdp2(
    names: tuple[str, ...], dims: dict[str, Any]
) -> None:
    """Parameters distributed on the full mesh (tensor parallel on "tp", Replicate on the
    data-parallel dims), the batch a DTensor sharded on the data-parallel dims: the sharded
    parameters live on FSDP2's mesh (the SPMD mesh; with two shard names the flattened
    data-parallel dim next to "tp") with our RaggedShard where FSDP2 has Shard(0), the
    unsharded ones are the original DTensors, and training equals FSDP2's bit for bit."""
    ours = _compare(2 ** len(names), _train_spmd, names, dims)
    placements = ours[0]["placements"]
    assert any(isinstance(p, RaggedShard) for p in placements), placements
    assert placements[-1] == Shard(0), placements


def _train_tp_hsdp(rank: int, world: int, impl: str) -> dict[str, Any]:
    api = engine(impl)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    model = make(Net)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    dp = mesh["replicate", "shard"]
    for block in model.blocks:
        api.fully_shard(block, mesh=dp)
    api.fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank // 2)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(4, 12, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weight = model.blocks[0].up.weight
    assert isinstance(weight, DTensor)
    return {
        "losses": losses,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},  # type: ignore[operator]
        "mesh": weight.device_mesh.mesh_dim_names,
        "placements": weight.placements,
    }


def test_tensor_parallel_with_hsdp_trains_bitwise_like_fsdp2() -> None:
    """``parallelize_module`` on "tp", ``fully_shard`` on the 2-D (replicate, shard) mesh of a
    3-D mesh (8 ranks): gradients reduce-scattered on "shard" and all-reduced on "replicate";
    the sharded parameters are (Replicate, RaggedShard, Shard(k)) DTensors on the 3-D mesh."""
    ours = _compare(8, _train_tp_hsdp)
    placements = ours[0]["placements"]
    assert placements[0] == Replicate() and isinstance(placements[1], RaggedShard)
    assert placements[2] == Shard(0) and ours[0]["mesh"] == ("replicate", "shard", "tp")


def _validation(rank: int, world: int, impl: str) -> dict[str, str]:
    api = engine(impl)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out: dict[str, str] = {}

    def capture(name: str, build: Any, **kwargs: Any) -> None:
        layer = make(lambda: nn.Linear(4, 4))
        build(layer)
        kwargs.setdefault("mesh", mesh)
        kwargs.setdefault("dp_mesh_dims", api.DataParallelMeshDims(shard="dp"))
        try:
            api.fully_shard(layer, **kwargs)
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"

    def on(target: Any, placements: list[Any]) -> Any:
        def build(layer: nn.Module) -> None:
            for name, param in list(layer.named_parameters()):
                value = distribute_tensor(param.detach(), target, placements)
                layer.register_parameter(name, nn.Parameter(value))

        return build

    capture("plain parameters", lambda layer: None)
    capture("another mesh object", on(other, [Replicate(), Replicate()]))
    capture("Shard on the shard dim", on(mesh, [Shard(0), Replicate()]))
    capture(
        "Shard on the replicate dim",
        on(mesh, [Replicate(), Shard(0)]),
        dp_mesh_dims=api.DataParallelMeshDims(replicate="tp", shard="dp"),
    )
    capture(
        "unknown dim name",
        on(mesh, [Replicate(), Replicate()]),
        dp_mesh_dims=api.DataParallelMeshDims(shard="x"),
    )
    unnamed = init_device_mesh("cpu", (world,))
    capture("mesh without dim names", on(unnamed, [Replicate()]), mesh=unnamed)
    capture(
        "reshard_after_forward=2", on(mesh, [Replicate(), Replicate()]), reshard_after_forward=2
    )
    try:
        api.DataParallelMeshDims()
    except ValueError as exc:
        out["neither shard nor replicate"] = str(exc)
    return out


def test_dp_mesh_dims_validation_is_fsdp2s() -> None:
    """FSDP2's errors, type and message, for every rule of ``dp_mesh_dims``: a plain
    parameter, a DTensor on another mesh object, a non-Replicate placement on a shard or
    replicate dim, an unknown dim name, a mesh without dim names, an int
    ``reshard_after_forward``; ``DataParallelMeshDims`` is FSDP2's own class."""
    assert fsdp_engine.DataParallelMeshDims is torch.distributed.fsdp.DataParallelMeshDims
    ours = run_threaded(_validation, 4, "ours")[0]
    theirs = run_threaded(_validation, 4, "fsdp2")[0]
    assert ours == theirs
    assert all(
        v.startswith(("ValueError", "NotImplementedError", "At least")) for v in ours.values()
    ), ours
