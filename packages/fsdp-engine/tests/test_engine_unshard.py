"""Unsharding on demand: ``FSDPModule.unshard`` / ``reshard`` and the handle,
``set_unshard_in_backward``, and ``reset_iter_state`` after a forward that raised.

Numeric kind of every value comparison here: *same arithmetic*: bitwise.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    ALL_GATHER,
    ENGINES,
    Mlp,
    Stack,
    counting,
    data,
    engine,
    full_grads,
    make,
    shard_stack,
)
from engine_models import TinyLlama
from engine_training import sharded_tiny_llama
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_engine import FSDPModule
from ragged_dtensor.testing import run_threaded


def test_fsdp_module_class() -> None:
    def body(rank: int, world: int) -> str:
        model, _ = sharded_tiny_llama(world)
        assert isinstance(model, FSDPModule) and isinstance(model, TinyLlama)
        model.unshard()
        assert not isinstance(model.head.weight, DTensor)
        model.reshard()
        assert isinstance(model.head.weight, DTensor)
        handle = model.layers[0].unshard(async_op=True)  # type: ignore[operator]
        assert handle is not None
        handle.wait()
        model.layers[0].reshard()  # type: ignore[operator]
        return type(model).__name__

    assert run_threaded(body, 2, timeout=60) == ["FSDPTinyLlama", "FSDPTinyLlama"]


@pytest.mark.numerics
def test_unshard_handle_and_dtensor_parameters_after_wait() -> None:
    def body(rank: int, world: int) -> bool:
        model = make(Stack)
        shard_stack(engine("ours"), model)
        handle = model.blocks[0].unshard(async_op=True)  # type: ignore[operator]
        assert handle is not None
        handle.wait()
        unsharded = not isinstance(model.blocks[0].up.weight, DTensor)
        model.blocks[0].reshard()  # type: ignore[operator]
        return unsharded and isinstance(model.blocks[0].up.weight, DTensor)

    assert all(run_threaded(body, 2))


class _Embedded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = Mlp()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.body(self.embed(tokens))


def _unshard_in_backward(rank: int, world: int, impl: str, unshard: bool) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(_Embedded)
    api.fully_shard(model.embed)
    api.fully_shard(model.body)
    api.fully_shard(model)
    if not unshard:
        model.embed.set_unshard_in_backward(False)  # type: ignore[operator]
    tokens = torch.randint(0, 16, (4,), generator=torch.Generator().manual_seed(rank))
    loss = model(tokens).sum()
    with counting() as counts:
        loss.backward()
    return counts.get(ALL_GATHER, 0), full_grads(model)


@pytest.mark.numerics
def test_set_unshard_in_backward_skips_the_gather_and_keeps_gradients() -> None:
    """An embedding's backward does not read its weight: ``set_unshard_in_backward(False)``
    saves its all-gather in backward and the gradients stay the same, like FSDP2."""
    for impl in ENGINES:
        (gathers_on, grads_on), *_ = run_threaded(_unshard_in_backward, 2, impl, True)
        (gathers_off, grads_off), *_ = run_threaded(_unshard_in_backward, 2, impl, False)
        assert gathers_off == gathers_on - 1, (impl, gathers_on, gathers_off)
        for name, grad in grads_on.items():
            assert torch.equal(grad, grads_off[name]), (impl, name)  # type: ignore[arg-type]


def _reset(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    model = make(Stack)
    shard_stack(engine("ours"), model)
    failing = {"on": True}

    def explode(module: nn.Module, args: Any) -> None:
        if failing["on"]:
            raise RuntimeError("boom")

    handle = model.blocks[1].register_forward_pre_hook(explode)
    with contextlib.suppress(RuntimeError):
        model(data(rank)).sum().backward()
    failing["on"] = False
    handle.remove()
    model.reset_iter_state()  # type: ignore[operator]
    model(data(rank)).sum().backward()
    fresh = make(Stack)
    shard_stack(engine("ours"), fresh)
    fresh(data(rank)).sum().backward()
    got, want = full_grads(model), full_grads(fresh)
    return all(torch.equal(got[n], want[n]) for n in want)  # type: ignore[arg-type]


@pytest.mark.numerics
def test_reset_iter_state_recovers_after_an_exception_in_forward() -> None:
    assert all(run_threaded(_reset, 2))
