"""Per-parameter meshes (``shard_placement_fn`` returning a ``ShardPlacementResult``) train like
FSDP2: MoE experts sharded on a mesh of their own, with FSDP and with HSDP.

Four ranks: the dense layers shard over all four; the experts over an FSDP mesh of two (each
pair of ranks holds its experts' shards, gradients averaged within the pair) or an HSDP mesh
(2 replicas x 2 shards: a reduce-scatter in the pair, an all-reduce across the replicas).

Numerics: the same arithmetic as torch's FSDP2 on the same script (one intra-op thread, the same
per-rank kernels, sums of two or four ranks' gradients in the same order): compared bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import make
from engine_training import assert_bitwise_equal
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementResult,
)
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

import fsdp_engine
from fsdp_engine._private.state import get_state
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import count_collectives, run_threaded

DIM, EXPERTS, STEPS = 8, 2, 3


class Moe(nn.Module):
    """Dense in, every token through every expert (weighted by a router), dense out."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM))
            for _ in range(EXPERTS)
        )
        self.out = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        gates = torch.softmax(self.router(h), dim=-1)
        mixed = sum(gates[:, e : e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return self.out(h + mixed)


def _expert_mesh_info(kind: str) -> Any:
    """``kind``: "fsdp" (a 1-D mesh of two ranks: this rank's pair) or "hsdp" (2 x 2)."""
    if kind == "fsdp":
        pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pair", "member"))
        return FSDPMeshInfo(pairs["member"], shard_mesh_dim=0)
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)


def _placement(case: str, param: torch.Tensor) -> Shard | None:
    """``"planned"``: None (ours: the planned layout; FSDP2: Shard(0)); ``"shard0"``;
    ``"shard1"``: Shard(1) of the matrices (Shard(0) of the biases)."""
    if case == "planned":
        return None
    return Shard(1) if case == "shard1" and param.dim() > 1 else Shard(0)


def _train(rank: int, world: int, impl: str, kind: str, case: str) -> dict[str, Any]:
    api: Any = fsdp_engine if impl == "ours" else torch_fsdp
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    info = _expert_mesh_info(kind)
    model = make(Moe)
    expert_params = {id(p) for p in model.experts.parameters()}

    def place(param: nn.Parameter) -> Any:
        if id(param) in expert_params:
            return ShardPlacementResult(_placement(case, param), info)
        return None

    for expert in model.experts:
        api.fully_shard(expert, mesh=mesh, shard_placement_fn=place)
    # the root's call holds dense parameters only: the experts' own calls hold theirs
    api.fully_shard(model, mesh=mesh, shard_placement_fn=place)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses, counts = [], {}
    for step in range(STEPS):
        x = torch.randn(6, DIM, generator=gen)
        with count_collectives() as counter:
            loss = model(x).square().mean()
            loss.backward()
        if step == 0:
            counts = dict(counter.calls)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if impl == "ours":
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor), name
            expert = name.startswith("experts.")
            assert param.device_mesh == (info.mesh if expert else mesh), (name, param.device_mesh)
            if expert and case != "planned":
                wanted = _placement(case, param)
                assert param.placements[-1] == wanted, (name, param.placements)
            else:
                assert isinstance(param.placements[-1], RaggedShard), (name, param.placements)
        state = get_state(model.experts[0])
        assert state is not None and [g.mesh for g in state.groups] == [info.mesh]
    params = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    return {"losses": losses, "params": params, "counts": counts}


CASES = [("fsdp", "planned"), ("fsdp", "shard0"), ("hsdp", "planned"), ("hsdp", "shard1")]


@pytest.mark.numerics
@pytest.mark.parametrize(("kind", "case"), CASES, ids=[f"{k}-{c}" for k, c in CASES])
def test_experts_on_a_mesh_of_their_own_train_like_fsdp2(kind: str, case: str) -> None:
    """The experts' groups live on their own mesh (their DTensors are on it, their collectives
    on its process groups; ``None``: our planned layout there, ``Shard(d)``: FSDP2's), the
    dense ones on the call's mesh; losses and parameters after three AdamW steps are FSDP2's,
    bitwise, with the same number of collectives of each kind."""
    ours = run_threaded(_train, 4, "ours", kind, case, timeout=240)
    theirs = run_threaded(_train, 4, "fsdp2", kind, case, timeout=240)
    for rank, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert_bitwise_equal(got, want, f"{kind} experts, {case}, rank {rank}")
        assert got["counts"] == want["counts"], (rank, got["counts"], want["counts"])


def _mixed_call(rank: int, world: int, impl: str) -> dict[str, Any]:
    """One call holding both: the dense parameters on the call's mesh, the experts' on theirs
    (two groups in one state, FSDP2's group per process group)."""
    api: Any = fsdp_engine if impl == "ours" else torch_fsdp
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    info = _expert_mesh_info("hsdp")
    model = make(Moe)
    expert_params = {id(p) for p in model.experts.parameters()}
    api.fully_shard(
        model,
        mesh=mesh,
        shard_placement_fn=lambda p, i=info: (
            ShardPlacementResult(None, i) if id(p) in expert_params else None
        ),
    )
    if impl == "ours":
        state = get_state(model)
        assert state is not None and [g.mesh for g in state.groups] == [mesh, info.mesh]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(6, DIM, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params}


@pytest.mark.numerics
def test_one_call_with_parameters_on_two_meshes_trains_like_fsdp2() -> None:
    ours = run_threaded(_mixed_call, 4, "ours", timeout=240)
    theirs = run_threaded(_mixed_call, 4, "fsdp2", timeout=240)
    for rank, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert_bitwise_equal(got, want, f"one call on two meshes, rank {rank}")


def _refused(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    two = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
    infos = {
        "a 2-D FSDPMeshInfo": FSDPMeshInfo(two, shard_mesh_dim=1),
        "HSDP sharding on dim 0": HSDPMeshInfo(two, shard_mesh_dim=0, replicate_mesh_dim=1),
    }
    out = []
    for info in infos.values():
        model = make(Moe)
        try:
            fsdp_engine.fully_shard(
                model, mesh=mesh, shard_placement_fn=lambda p, i=info: ShardPlacementResult(None, i)
            )
        except NotImplementedError as exc:
            out.append(str(exc))
        else:
            out.append("no error")
    return out


def test_mesh_infos_we_cannot_lay_out_are_refused_naming_the_parameter() -> None:
    for message in run_threaded(_refused, 4)[0]:
        assert "'inp.weight'" in message and "per-parameter meshes" in message, message
