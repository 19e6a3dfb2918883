"""torchao's float8 training with ``enable_fsdp_float8_all_gather=True`` on fsdp_engine against
torch's FSDP2 (the ``float8`` nox session: ``examples[float8]`` pins torchao; GEMMs emulated on
the CPU with ``Float8LinearConfig(emulate=True)``).

torchao's ``WeightWithDynamicFloat8CastTensor`` casts each rank's shard to float8 in
``fsdp_pre_all_gather`` (the scale from the amax all-reduced over the shard mesh, or the one
``precompute_float8_dynamic_scale_for_fsdp`` set), so the all-gather moves float8 bytes and
``fsdp_post_all_gather`` builds a ``Float8TrainingTensor`` the float8 matmul consumes.
Numerics: the same arithmetic on both engines (same chunks, same scales, same float8 bytes),
compared bitwise: every loss and every trained parameter.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torchao.float8 import (
    Float8LinearConfig,
    convert_to_float8_training,
    precompute_float8_dynamic_scale_for_fsdp,
)

from ragged_dtensor.testing import run_processes, run_threaded

# torchao is the examples' ``float8`` extra, not a package's dependency: this file runs in the
# ``float8`` nox session (``integration`` and ``slow`` leave it out)

STEPS = 4
_LOCK = threading.Lock()


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up = nn.Linear(32, 64)
        self.down = nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def _api(impl: str) -> Any:
    if impl == "ours":
        import fsdp_engine

        return fsdp_engine
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp


def train(rank: int, world: int, impl: str, precompute: bool, hsdp: bool) -> dict[str, Any]:
    api = _api(impl)
    with _LOCK, torch.random.fork_rng():  # threaded ranks share torch's generator
        torch.manual_seed(0)
        model = Net()
    config = Float8LinearConfig(emulate=True, enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(
        model, config=config, module_filter_fn=lambda mod, fqn: fqn not in ("inp", "out")
    )
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    seen: list[str] = []
    model.blocks[0].up.register_forward_pre_hook(lambda m, _: seen.append(type(m.weight).__name__))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(STEPS):
        loss = model(torch.randn(8, 16, generator=gen)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        losses.append(loss.item())
    weight = model.blocks[0].up.weight
    assert isinstance(weight, DTensor)
    return {
        "losses": losses,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},
        "local": type(weight.to_local()).__name__,
        "placement": weight.placements[-1],
        "unsharded": seen[-1],
    }


def _check(ours: list[dict[str, Any]], theirs: list[dict[str, Any]]) -> None:
    for mine, control in zip(ours, theirs, strict=True):
        assert mine["losses"] == control["losses"], (mine["losses"], control["losses"])
        for name, value in control["params"].items():
            assert torch.equal(mine["params"][name], value), name
        assert mine["local"] == control["local"] == "WeightWithDynamicFloat8CastTensor"
        assert mine["unsharded"] == control["unsharded"] == "Float8TrainingTensor"
        assert mine["placement"] == control["placement"] == Shard(0)


@pytest.mark.parametrize(
    ("world", "precompute", "hsdp"),
    [(2, False, False), (2, True, False), (4, False, True)],
    ids=["dynamic-scale", "precomputed-scale", "hsdp"],
)
def test_float8_all_gather_trains_bitwise_like_fsdp2(
    world: int, precompute: bool, hsdp: bool
) -> None:
    """Threaded ranks: the weights stay torchao's subclass in FSDP2's ``Shard(0)`` layout, the
    unsharded weight is the ``Float8TrainingTensor`` the post-hook built, and every loss and
    parameter equals FSDP2's."""
    ours = run_threaded(train, world, "ours", precompute, hsdp, timeout=600)
    theirs = run_threaded(train, world, "fsdp2", precompute, hsdp, timeout=600)
    _check(ours, theirs)


def test_float8_all_gather_on_gloo_processes_like_fsdp2() -> None:
    """Two gloo processes (the bytes gathered by a real backend)."""
    ours = run_processes(train, 2, "ours", False, False, timeout=600)
    theirs = run_processes(train, 2, "fsdp2", False, False, timeout=600)
    _check(ours, theirs)
