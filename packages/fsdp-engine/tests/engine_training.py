"""Training loops shared by the parity tests: ours, torch FSDP2, the single-process reference."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from engine_models import RNG_LOCK, TinyLlama, batches, build, loss_fn
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
}


_INIT_CACHE: dict[int, dict[str, torch.Tensor]] = {}


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The same initial weights for every rank. Threaded ranks share torch's global generator,
    so the weights are made once, under a lock, and copied."""
    with RNG_LOCK:
        if seed not in _INIT_CACHE:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                _INIT_CACHE[seed] = {k: v.clone() for k, v in TinyLlama().state_dict().items()}
        return {k: v.clone() for k, v in _INIT_CACHE[seed].items()}


def reference(
    steps: int,
    world: int,
    optimizer: str = "adamw",
    micro: int = 1,
    dtype: torch.dtype | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, the whole global batch per step."""
    model = build()
    model.load_state_dict(initial_state())
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    data = batches(steps * micro, world)
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            loss = loss_fn(model, data[step * micro + m]) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_sharded(
    rank: int,
    world: int,
    *,
    engine: str = "ours",
    steps: int = 10,
    optimizer: str = "adamw",
    mesh_shape: tuple[int, ...] | None = None,
    micro: int = 1,
    reshard_after_forward: bool | int = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Each rank trains on its slice of the same global batches; returns losses and full params.

    ``engine``: "ours" (fsdp_engine.fully_shard) or "fsdp2" (torch's), with identical calls.
    """
    if engine == "ours":
        api: Any = fsdp_engine
    else:
        import torch.distributed.fsdp as api
    shape = mesh_shape or (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = build()
    model.load_state_dict(initial_state())
    mp = api.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt = OPTIMIZERS[optimizer](model.parameters())
    data = batches(steps * micro, world)
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for m in range(micro):
            last = m == micro - 1
            model.set_requires_gradient_sync(last)
            local = data[step * micro + m].chunk(world)[rank]
            loss = loss_fn(model, local) / micro
            loss.backward()
            total += loss.detach().float()
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    final = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return {"losses": losses, "params": final}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    worst = 0.0
    for key, want in b.items():
        scale = want.float().abs().max().clamp_min(1e-12)
        worst = max(worst, ((a[key].float() - want.float()).abs().max() / scale).item())
    return worst
