"""No per-step construction: after the first step, forward + backward build no DTensor and no
buffer; the sharded gradients' buffer and views survive ``zero_grad(set_to_none=True)`` (their
memory is released and re-allocated in place), unless a user still holds one.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine
from dbuffer import DBuffer
from fsdp_engine._private.state import get_state
from ragged_dtensor.testing import run_threaded

# The ranks are threads sharing torch's global generator: seeding and building under one lock
# gives every rank the same initial values (fully_shard compares frozen parameters' values).
_BUILD = threading.Lock()


def _model(world: int, frozen: bool) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(6, 6), nn.ReLU()) for _ in range(3)))
    if frozen:  # a group with a frozen member reduces compactly
        model[1][0].bias.requires_grad_(False)
    for layer in model:
        fsdp_engine.fully_shard(layer, mesh=mesh)
    fsdp_engine.fully_shard(model, mesh=mesh)
    return model


_LOCAL = threading.local()  # the ranks are threads: each counts its own constructions


def _counted(fn: Any, kind: str) -> Any:
    def counting(*args: Any, **kwargs: Any) -> Any:
        if getattr(_LOCAL, "counting", False):
            _LOCAL.counts[kind] += 1
        return fn(*args, **kwargs)

    return counting


def _counting(rank: int, world: int, frozen: bool) -> dict[str, Any]:
    model = _model(world, frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    _LOCAL.counts = {"dtensors": 0, "buffers": 0}
    seen: list[list[int]] = []
    released: list[bool] = []
    states = [get_state(layer) for layer in model]

    def after_forward(module: nn.Module, args: Any, output: Any) -> None:
        # the previous step's gradients were dropped by zero_grad: every layer's pre-forward
        # released their memory
        grads = [
            g.reducer.grads.buffer
            for s in states
            if s is not None
            for g in s.groups
            if g.reducer.grads.buffer is not None
        ]
        released.append(bool(grads) and all(not b.shard_allocated for b in grads))

    model.register_forward_hook(after_forward)
    for step in range(4):
        _LOCAL.counting = step >= 1
        model(x).sum().backward()
        _LOCAL.counting = False
        seen.append([id(p.grad) for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {
        **_LOCAL.counts,
        "same_grads": all(s == seen[0] for s in seen),
        "released": released[1:],
    }


def test_no_construction_per_step() -> None:
    """Steps 2-4: forward + backward construct no DTensor and no DBuffer; every ``.grad`` is the
    same object each step; by the end of each forward the dropped gradients' memory is
    released (and re-allocated by the reduction)."""
    saved = DTensor.__new__, DBuffer.__init__, DBuffer.new_like
    DTensor.__new__ = staticmethod(_counted(saved[0], "dtensors"))  # type: ignore[assignment]
    DBuffer.__init__ = _counted(saved[1], "buffers")  # type: ignore[method-assign]
    DBuffer.new_like = _counted(saved[2], "buffers")  # type: ignore[method-assign]
    try:
        for frozen in (False, True):
            for result in run_threaded(_counting, 2, frozen, timeout=120):
                assert result["dtensors"] == 0 and result["buffers"] == 0, (frozen, result)
                assert result["same_grads"], frozen
                assert result["released"] == [True, True, True], (frozen, result)
    finally:
        DTensor.__new__, DBuffer.__init__, DBuffer.new_like = saved  # type: ignore[method-assign,assignment]


def _held(rank: int, world: int) -> dict[str, Any]:
    model = _model(world, False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()
    kept = next(iter(model.parameters())).grad
    assert isinstance(kept, DTensor)
    before = kept.to_local().clone()
    opt.step()
    opt.zero_grad(set_to_none=True)
    (2 * model(x)).sum().backward()  # different gradients
    now = next(iter(model.parameters())).grad
    assert isinstance(now, DTensor)
    return {
        "kept_unchanged": torch.equal(kept.to_local(), before),
        "new_object": now is not kept,
        "differs": not torch.equal(now.to_local(), before) or before.numel() == 0,
    }


def test_a_kept_gradient_is_never_reused_under_its_holder() -> None:
    """A user holding ``p.grad`` across ``zero_grad(set_to_none=True)`` keeps its values: the
    buffer is left to them and the next step's gradients live in a new one."""
    for result in run_threaded(_held, 2, timeout=120):
        assert result == {"kept_unchanged": True, "new_object": True, "differs": True}
