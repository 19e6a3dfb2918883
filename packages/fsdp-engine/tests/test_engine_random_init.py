"""Sharded random init equals a single device's init with the same seed, for every parameter and
whatever the layout: meta-device init, ``fully_shard``, ``to_empty``, ``reset_parameters()``.

A random fill of a RaggedShard parameter draws the whole tensor from the generator a single
device would use and keeps this rank's share ([Note: random init of ragged shards] in
ragged_dtensor's random.py), so every rank consumes the stream exactly like one device.

Numeric kind: *same arithmetic* (the same draws and the same elementwise init maths), compared
bitwise. Real gloo processes use torch's default generator (``torch.manual_seed`` on every rank,
as users do); the threaded variant passes explicit generators because threads share one.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_processes, run_threaded

pytestmark = pytest.mark.numerics


class _Scaled(nn.Module):
    """A module with its own init (truncated normal, as ViT/GPT-style code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(7, 5))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.conv = nn.Conv1d(5, 5, 3, padding=1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(5), nn.Linear(5, 9), nn.GELU(), nn.Linear(9, 5))
            for _ in range(2)
        )
        self.head = _Scaled()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = self.conv(x.transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


LAYOUTS: dict[str, dict[str, Any]] = {
    "planned": {},
    "whole rows": {"block_policy": lambda name, p: p.shape[-1] if p.dim() > 1 else 1},
    "concatenated": {"planner": "naive"},
}


def _reset(model: nn.Module) -> None:
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _single_device(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _Net()
    model.to_empty(device="cpu")
    _reset(model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _sharded_init(rank: int, world: int, layout: str, seed: int) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = _Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **LAYOUTS[layout])
    fully_shard(model, mesh=mesh, **LAYOUTS[layout])
    model.to_empty(device="cpu")
    _reset(model)
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _all_layouts(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    torch.set_num_threads(1)
    return {layout: _sharded_init(rank, world, layout, seed=3) for layout in LAYOUTS}


@pytest.mark.multiprocess
def test_meta_init_then_reset_parameters_equals_one_device_on_processes() -> None:
    want = _single_device(seed=3)
    for by_layout in run_processes(_all_layouts, 2, timeout=240):
        for layout, params in by_layout.items():
            for name, value in want.items():
                assert torch.equal(params[name], value), (layout, name)
    # the shards are not copies of one stream (the bug this fixes): both halves of a matrix
    # differ from each other and from the first numbers of the stream
    assert not torch.equal(want["blocks.0.1.weight"][:4], want["blocks.0.1.weight"][4:8])


def _explicit_generator_init(rank: int, world: int, layout: str) -> dict[str, torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = _Net()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **LAYOUTS[layout])
    fully_shard(model, mesh=mesh, **LAYOUTS[layout])
    model.to_empty(device="cpu")
    _fill(model, torch.Generator().manual_seed(5))
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _fill(model: nn.Module, gen: torch.Generator) -> None:
    for name, p in model.named_parameters():
        if p.dim() > 1:
            nn.init.kaiming_uniform_(p, a=math.sqrt(5), generator=gen)
        elif name.endswith("bias"):
            nn.init.uniform_(p, -0.1, 0.1, generator=gen)
        else:
            nn.init.normal_(p, 1.0, 0.1, generator=gen)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_explicit_generator_init_equals_one_device_threaded(world: int, layout: str) -> None:
    with torch.device("meta"):
        reference = _Net()
    reference.to_empty(device="cpu")
    _fill(reference, torch.Generator().manual_seed(5))
    for params in run_threaded(_explicit_generator_init, world, layout):
        for name, value in reference.named_parameters():
            assert torch.equal(params[name], value.detach()), (world, layout, name)
