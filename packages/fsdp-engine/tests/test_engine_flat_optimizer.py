"""FlatShardOptimizer: an elementwise optimizer over each group's flat shard gives the same
values as the same optimizer over the per-parameter DTensors (one kernel per group).

Numerics: FlatShardOptimizer against per-parameter AdamW is the same arithmetic per element
(threaded ranks in one process, one thread setting): bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_models import batches, build, loss_fn
from engine_training import initial_state
from torch.distributed.tensor import DTensor, init_device_mesh

from fsdp_engine import FlatShardOptimizer, fully_shard
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def _train(rank: int, world: int, flat: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    model = build()
    model.load_state_dict(initial_state())
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    kwargs = {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}
    opt: Any = (
        FlatShardOptimizer(model, torch.optim.AdamW, **kwargs)
        if flat
        else torch.optim.AdamW(model.parameters(), **kwargs)
    )
    losses = []
    for tokens in batches(4, world):
        loss = loss_fn(model, tokens.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    params = {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }
    return {"losses": losses, "params": params}


def test_flat_shard_adamw_equals_per_parameter_adamw() -> None:
    per_param = run_threaded(_train, 2, False, timeout=120)
    flat = run_threaded(_train, 2, True, timeout=120)
    for a, b in zip(flat, per_param, strict=True):
        assert a["losses"] == b["losses"]
        for key, value in b["params"].items():
            assert torch.equal(a["params"][key], value), key
