"""``shard_placement_fn`` returning ``Shard(d > 0)`` for a tensor-parallel parameter gives
FSDP2's sharded DTensor and trains like FSDP2, with FSDP and with HSDP on the data-parallel axes.

The data-parallel ranks split each parameter's tensor-parallel shard along dim ``d`` (FSDP2's
rule): a column-parallel weight (``Shard(0)`` on "tp") placed on ``Shard(1)`` is ``(Shard(1),
Shard(0))`` on ("dp", "tp"); a row-parallel weight (``Shard(1)`` on "tp") placed on ``Shard(1)``
is ``(_StridedShard(1, 2), Shard(1))``: the data-parallel chunks interleave with the
tensor-parallel ones.

Numerics: the same arithmetic as torch's FSDP2 on the same script (one intra-op thread, the same
per-rank kernels and collectives in the same order): compared bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import make
from engine_training import assert_bitwise_equal
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import fsdp_engine
from ragged_dtensor.testing import run_threaded

DIM, HIDDEN, STEPS = 8, 24, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _placement(case: str, param: nn.Parameter) -> Shard | None:
    """``"shard1"``: ``Shard(1)`` for every matrix; ``"largest"``: its largest local dim (FSDP2's
    tests' choice); vectors stay on the default (ours: planned, FSDP2: ``Shard(0)``)."""
    if param.dim() < 2:
        return None
    if case == "shard1":
        return Shard(1)
    local = param.to_local() if isinstance(param, DTensor) else param
    sizes = list(local.shape)
    return Shard(sizes.index(max(sizes)))


def _train(rank: int, world: int, impl: str, case: str, hsdp: bool) -> dict[str, Any]:
    api: Any = fsdp_engine if impl == "ours" else torch_fsdp
    torch.set_num_threads(1)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "dp", "tp"))
        dp_mesh = mesh["rep", "dp"]
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"]
    model = make(Model)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})

    def place(param: nn.Parameter) -> Shard | None:
        return _placement(case, param)

    # Shard(0) of a tensor-parallel parameter is our planned layout cut between rows (the
    # README's design differences): FSDP2's layout is compared where d > 0
    placed = {n for n, p in model.named_parameters() if (s := place(p)) is not None and s.dim}

    for block in model.blocks:
        api.fully_shard(block, mesh=dp_mesh, shard_placement_fn=place)
    api.fully_shard(model, mesh=dp_mesh, shard_placement_fn=place)
    layouts = {
        name: (tuple(p.placements), p.to_local().clone())
        for name, p in model.named_parameters()
        if name in placed
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dp_mesh.get_rank())
    losses = []
    for _ in range(STEPS):
        x = torch.randn(4, DIM, generator=gen)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "layouts": layouts}


CASES = [("shard1", False), ("largest", False), ("shard1", True)]


@pytest.mark.numerics
@pytest.mark.parametrize(
    ("case", "hsdp"), CASES, ids=[f"{c}-{'hsdp' if h else 'fsdp'}" for c, h in CASES]
)
def test_shard_d_of_a_tensor_parallel_parameter_is_fsdp2s(case: str, hsdp: bool) -> None:
    """The sharded parameters have FSDP2's placements on the data-parallel and tensor-parallel
    meshes and its local tensors; losses and parameters after three AdamW steps are FSDP2's,
    bitwise."""
    world = 8 if hsdp else 4
    ours = run_threaded(_train, world, "ours", case, hsdp, timeout=240)
    theirs = run_threaded(_train, world, "fsdp2", case, hsdp, timeout=240)
    strided = 0
    for rank, (got, want) in enumerate(zip(ours, theirs, strict=True)):
        assert_bitwise_equal(got, want, f"{case}, hsdp={hsdp}, rank {rank}")
        assert sorted(got["layouts"]) == sorted(want["layouts"])
        for name, (placements, local) in want["layouts"].items():
            ours_placements, ours_local = got["layouts"][name]
            assert ours_placements == placements, (rank, name, ours_placements, placements)
            assert torch.equal(ours_local, local), (rank, name)
            strided += any("StridedShard" in type(p).__name__ for p in placements)
    if case == "shard1":  # the row-parallel weights: Shard(1) on "tp" as well
        assert strided > 0
