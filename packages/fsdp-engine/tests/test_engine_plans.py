"""Plans at scale: 16-byte aligned views in every dtype of a group, plans cached by signature.

- every tensor view of a group's buffers (sharded parameters and gradients in the parameter
  dtype, unsharded parameters in the compute dtype, unsharded gradients) starts on a 16-byte
  boundary, with odd sizes and bf16 mixed precision;
- whole-model planning of every catalogue model at m = 8, 1024 and 16384 takes at most 1 s of
  CPU time, planning each distinct layer once;
- ``fully_shard`` on identical layers plans once.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine
from fsdp_engine._private.plans import alignment, cached_plan, clear_plan_cache, plan_cache_info
from fsdp_engine._private.state import get_state
from ragged_dtensor.testing import run_threaded
from shard_planner import TensorSpec
from shard_planner.projection import MODELS, catalogue_model

_BUILD = threading.Lock()


class Odd(nn.Module):
    """Parameters whose sizes are not multiples of 4 or 8 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(13)
        self.a = nn.Linear(13, 7)
        self.b = nn.Linear(7, 13)
        self.scale = nn.Parameter(torch.ones(1))  # FSDP2 refuses 0-d parameters; so do we

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(self.norm(x)))) * self.scale


def _aligned(t: torch.Tensor) -> bool:
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() == 0 or local.data_ptr() % 16 == 0


def _check_alignment(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:  # the ranks are threads sharing torch's generator: the same weights on each
        torch.manual_seed(0)
        model = nn.Sequential(Odd(), Odd())
    policy = fsdp_engine.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for layer in model:
        fsdp_engine.fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    fsdp_engine.fully_shard(model, mesh=mesh, mp_policy=policy)
    out = model(torch.randn(3, 13))
    seen: dict[str, Any] = {"offset_align": set(), "checked": 0}
    for layer in model:
        state = get_state(layer)
        assert state is not None and state.group is not None
        group = state.group
        plan = layer.shard_plan()  # type: ignore[operator]
        seen["offset_align"].add(plan.offset_align)
        assert plan.shard_size % 8 == 0 and all(o % 8 == 0 for o in plan.offsets)
        for tensor in group.storage.buffer.local_views():  # fp32 sharded storage
            assert _aligned(tensor)
            seen["checked"] += 1
        for param in group.unsharded_params():  # bf16 unsharded storage, still gathered
            assert param.dtype == torch.bfloat16 and _aligned(param)
            seen["checked"] += 1
    out.float().sum().backward()
    for param in model.parameters():
        assert param.grad is not None and _aligned(param.grad)
        assert _aligned(param)
        seen["checked"] += 2
    return seen


def test_views_are_16_byte_aligned_in_every_dtype() -> None:
    """fp32 parameters computed in bf16: offsets and shard sizes are multiples of 8 elements
    (16 bytes in bf16, 32 in fp32), so every view of every storage is 16-byte aligned."""
    for world in (2, 3):
        results = run_threaded(_check_alignment, world, timeout=120)
        assert all(r["offset_align"] == {8} and r["checked"] > 20 for r in results)


def test_alignment_is_16_bytes_in_every_dtype() -> None:
    assert alignment([torch.float32]) == 4
    assert alignment([torch.float32, torch.bfloat16]) == 8
    assert alignment([torch.float32, torch.bfloat16, torch.float8_e4m3fn]) == 16
    assert alignment([torch.float64]) == 2
    assert alignment([torch.complex128]) == 1


def test_whole_model_planning_of_the_catalogue_within_a_second() -> None:
    """Every catalogue model, every layer instance planned as ``fully_shard`` plans it (own
    parameter names, element blocks and 128-row blocks), from an empty cache: at most 1 s of
    CPU time per model and world size (``time.process_time``, this process's own work), and
    one planner run per distinct layer."""
    for rows in (0, 128):
        for name in MODELS:
            model = catalogue_model(name)
            for world in (8, 1024, 16384):
                clear_plan_cache()
                start = time.process_time()
                for group in model.groups:
                    for layer in range(group.count):
                        specs = [
                            TensorSpec(s.numel, s.block, f"{group.name}.{layer}.{s.name}")
                            for s in group.specs(rows)
                        ]
                        plan = cached_plan(specs, world, (torch.float32,), method="auto")
                        assert plan.names == tuple(s.name for s in specs)
                        assert plan.offset_align == 4
                seconds = time.process_time() - start
                assert seconds <= 1.0, (name, world, rows, seconds)
                info = plan_cache_info()
                assert info["misses"] == len(model.groups), (name, info)
                assert info["hits"] == sum(g.count for g in model.groups) - len(model.groups)


def _identical_layers(rank: int, world: int) -> list[tuple[str, ...]]:
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 6)) for _ in range(4)))
    for layer in model:
        fsdp_engine.fully_shard(layer, mesh=mesh)
    names = []
    for layer in model:
        plan = layer.shard_plan()  # type: ignore[operator]
        names.append(plan.names)
    return names


def test_identical_layers_plan_once() -> None:
    clear_plan_cache()
    names = run_threaded(_identical_layers, 2, timeout=60)[0]
    info = plan_cache_info()
    # two ranks (threads) each plan the first layer: at most two misses, the rest hits
    assert info["misses"] <= 2 and info["hits"] >= 2 * 4 - info["misses"]
    assert names == [("0.weight", "0.bias", "1.weight", "1.bias")] * 4
