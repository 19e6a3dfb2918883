"""Shared by the reliability tests: build a sharded TinyLlama + optimizer, train, take snapshots."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from engine_models import TinyLlama, batches, loss_fn
from engine_training import initial_state
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine

GLOBAL_BATCHES = 4  # every run sees the same global batches, whatever its world size


def build(
    world: int,
    *,
    engine: str = "ours",
    lr: float = 1e-2,
    mesh_shape: tuple[int, ...] | None = None,
    row_blocks: bool = False,
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A TinyLlama sharded per layer and at the root, and an AdamW over its parameters.
    ``mesh_shape`` (default ``(world,)``): a 2-D shape is HSDP (replicate, shard).
    ``row_blocks``: a block policy keeping every matrix row whole (another plan)."""
    api: Any
    if engine == "ours":
        api = fsdp_engine
    else:
        import torch.distributed.fsdp as api
    shape = mesh_shape or (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = TinyLlama()
    model.load_state_dict(initial_state())
    kwargs: dict[str, Any] = {}
    if row_blocks:
        kwargs["block_policy"] = lambda name, p: int(p.shape[-1]) if p.dim() > 1 else 1
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    return model, opt


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    world: int,
    *,
    start: int,
    steps: int,
) -> list[float]:
    """Steps ``start .. start + steps - 1`` of one fixed data stream; the global-mean losses.

    Every global batch is ``GLOBAL_BATCHES`` sequences split over the ranks, so a run at any
    world size sees the same data (gradients are averaged over the ranks).
    """
    data = batches(start + steps, 1, batch=GLOBAL_BATCHES)[start:]
    losses = []
    for tokens in data:
        loss = loss_fn(model, tokens.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def full_snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor as a full (unsharded) tensor, by FQN.

    Collective (``full_tensor`` on each DTensor, in the same order on every rank).
    """
    model_sd, optim_sd = get_state_dict(model, opt)
    out: dict[str, torch.Tensor] = {}
    for key, value in model_sd.items():
        out[f"model.{key}"] = _full(value)
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{fqn}.{key}"] = _full(value)
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone()


def assert_bitwise_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)),)
    for key, value in want.items():
        assert got[key].dtype == value.dtype, key
        assert got[key].shape == value.shape, (key, got[key].shape, value.shape)
        assert torch.equal(got[key], value), f"{key}: differs after the round trip"
