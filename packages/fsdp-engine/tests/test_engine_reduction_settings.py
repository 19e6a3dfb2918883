"""Reduction settings are honoured: reductions in flight (``set_reduce_scatter_max_input_buffers``),
a custom reduce-scatter with its allocator and no buffer made per call, and the all-reduce hook."""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_engine
from dbuffer import DBuffer
from fsdp_engine._private.param_group import ParamGroup
from ragged_dtensor.testing import run_threaded

_BUILD = threading.Lock()  # ranks are threads sharing torch's generator
_LOCAL = threading.local()


def _model(world: int, layers: int = 4) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(layers)))
    for layer in model:
        fsdp_engine.fully_shard(layer, mesh=mesh)
    fsdp_engine.fully_shard(model, mesh=mesh)
    return model


def _waits_in_backward(rank: int, world: int, cap: int | None) -> int:
    """How often backward waits for an earlier reduction before issuing the next (the final
    callback's waits excluded)."""
    model = _model(world)
    if cap is not None:
        model.set_reduce_scatter_max_input_buffers(cap)  # type: ignore[operator]
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    _LOCAL.waits = 0
    _LOCAL.counting = False
    model(x).sum().backward()  # the first step: no prediction yet, same for every cap
    _LOCAL.counting = True
    loss = model(x).sum()
    root = model.__dict__["_fsdp_engine_state"]
    real_final = root._final_callback

    def final() -> None:
        _LOCAL.counting = False
        real_final()

    root._final_callback = final
    loss.backward()
    return int(_LOCAL.waits)


def test_max_input_buffers_sets_the_reductions_in_flight() -> None:
    """Layers 3, 2 and 1 reduce in backward (layer 0, whose input needs no gradient, in the
    final callback; the root has no parameters). One in flight (FSDP2's default): layers 2 and
    1 each wait for the one before; two in flight: only layer 1 waits (for layer 3). Before the
    setting was honoured it was accepted and ignored (2 waits either way)."""
    real = ParamGroup.wait_for_reduce_input  # the cap's wait ([Note: reductions in flight])

    def counted(self: ParamGroup) -> None:
        if getattr(_LOCAL, "counting", False) and self.reducer.handle is not None:
            _LOCAL.waits += 1
        real(self)

    ParamGroup.wait_for_reduce_input = counted  # type: ignore[method-assign]
    try:
        default = run_threaded(_waits_in_backward, 2, None)
        two = run_threaded(_waits_in_backward, 2, 2)
    finally:
        ParamGroup.wait_for_reduce_input = real  # type: ignore[method-assign]
    assert default == [2, 2], default
    assert two == [1, 1], two


class _CustomReduceScatter:
    """A user reduce-scatter (FSDP2's ``ReduceScatter`` interface): records its calls and
    provides the receive buffer through ``allocate``."""

    def __init__(self) -> None:
        self.calls = 0
        self.allocated = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocated += 1
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        self.calls += 1
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


def _custom(rank: int, world: int) -> dict[str, Any]:
    model = _model(world, layers=2)
    comm = _CustomReduceScatter()
    hooked: list[float] = []

    def hook(reduced: torch.Tensor) -> None:
        hooked.append(float(reduced.abs().sum()))

    for layer in (*model, model):
        layer.set_custom_reduce_scatter(comm)  # type: ignore[operator]
        layer.set_all_reduce_hook(hook)  # type: ignore[operator]
    reference = _model(world, layers=2)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    buffers = [0]
    real_init, real_new_like = DBuffer.__init__, DBuffer.new_like

    def count_init(self: DBuffer, *args: Any, **kwargs: Any) -> None:
        buffers[0] += 1
        real_init(self, *args, **kwargs)

    def count_new_like(self: DBuffer, *args: Any, **kwargs: Any) -> DBuffer:
        buffers[0] += 1
        return real_new_like(self, *args, **kwargs)

    for step in range(3):
        if step == 2:
            DBuffer.__init__ = count_init  # type: ignore[method-assign]
            DBuffer.new_like = count_new_like  # type: ignore[method-assign]
        try:
            model(x).sum().backward()
            reference(x).sum().backward()
        finally:
            DBuffer.__init__ = real_init  # type: ignore[method-assign]
            DBuffer.new_like = real_new_like  # type: ignore[method-assign]
    grads = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
    want = [p.grad.full_tensor() for p in reference.parameters()]  # type: ignore[union-attr]
    return {
        "calls": comm.calls,
        "allocated": comm.allocated,
        "hooked": len(hooked),
        "buffers in step 3": buffers[0],
        "same": all(torch.equal(a, b) for a, b in zip(grads, want, strict=True)),
    }


def test_custom_reduce_scatter_uses_its_allocator_and_makes_no_buffer_per_call() -> None:
    """2 groups (the root has no parameters) x 3 steps: the user reduce-scatter runs each time,
    its ``allocate`` makes the receive buffer, the all-reduce hook sees every reduced shard,
    gradients equal the built-in path's, and the third step builds no buffer (it used to build
    one per call)."""
    for result in run_threaded(_custom, 2):
        assert result["calls"] == 6 and result["allocated"] == 6, result
        assert result["hooked"] == 6, result
        assert result["buffers in step 3"] == 0, result
        assert result["same"], result
