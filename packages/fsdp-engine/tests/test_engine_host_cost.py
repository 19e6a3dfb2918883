"""What a step builds, and how long sharded gradients live: after the first step, forward +
backward build no buffer and no DTensor while ``.grad`` is kept (``zero_grad(set_to_none=
False)``); with ``set_to_none=True`` the gradients' memory is freed at ``zero_grad`` (no
gradient memory between steps, like FSDP2) and the next reduction builds one buffer and one
DTensor per trainable parameter per group (FSDP2 builds one DTensor per parameter per step);
a ``.grad`` a user keeps is never written under them.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine
from dbuffer import DBuffer
from ragged_dtensor.testing import run_processes, run_threaded

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


def _counting(rank: int, world: int, frozen: bool, set_to_none: bool) -> dict[str, Any]:
    """Real gloo processes: the threaded process group's work objects hold their tensors in
    reference cycles (freed only by the garbage collector), which would hide when the engine
    lets a storage go."""
    saved = DTensor.__new__, DBuffer.__init__, DBuffer.new_like
    DTensor.__new__ = staticmethod(_counted(saved[0], "dtensors"))  # type: ignore[assignment]
    DBuffer.__init__ = _counted(saved[1], "buffers")  # type: ignore[method-assign]
    DBuffer.new_like = _counted(saved[2], "buffers")  # type: ignore[method-assign]
    model = _model(world, frozen)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    _LOCAL.counts = {"dtensors": 0, "buffers": 0}
    freed: list[bool] = []
    for step in range(4):
        _LOCAL.counting = step >= 1
        model(x).sum().backward()
        _LOCAL.counting = False
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        storages = [weakref.ref(g.to_local().untyped_storage()) for g in grads[:1]]
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        del grads
        # freed right at zero_grad: the storage object died with the last .grad
        freed.append(all(ref() is None for ref in storages))
    trainable = sum(p.requires_grad for p in model.parameters())
    DTensor.__new__, DBuffer.__init__, DBuffer.new_like = saved  # type: ignore[method-assign,assignment]
    return {**_LOCAL.counts, "trainable": trainable, "freed": freed}


def _every_case(rank: int, world: int) -> dict[tuple[bool, bool], dict[str, Any]]:
    cases = [(frozen, drop) for frozen in (False, True) for drop in (False, True)]
    return {case: _counting(rank, world, *case) for case in cases}


def test_what_a_step_builds_and_when_gradients_are_freed() -> None:
    for results in run_processes(_every_case, 2, timeout=180):  # one launch for every case
        for (frozen, drop), result in results.items():
            if not drop:  # .grad kept: accumulated in place, nothing built
                assert result["dtensors"] == 0 and result["buffers"] == 0, (frozen, result)
                assert result["freed"] == [False] * 4, (frozen, result)
            else:  # 3 groups with gradients, steps 2-4
                assert result["buffers"] == 3 * 3, (frozen, result)
                assert result["dtensors"] == 3 * result["trainable"], (frozen, result)
                assert result["freed"] == [True] * 4, (frozen, result)


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
    storage is left to them and the next step's gradients live in a new one."""
    for result in run_threaded(_held, 2, timeout=120):
        assert result == {"kept_unchanged": True, "new_object": True, "differs": True}
