"""Gradient accumulation without sync (``set_requires_gradient_sync(False)``): micro-batches
accumulate the unsharded gradients, in the reduce dtype, and one reduction follows, like one
process and FSDP2.

Numeric kind of every value comparison here: *same arithmetic*: bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    Stack,
    data,
    engine,
    full_grads,
    make,
    recording_reduce_scatter,
    shard_stack,
)
from engine_training import check_bitwise, per_rank_reference, train_sharded

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def test_gradient_accumulation_without_sync() -> None:
    """Same arithmetic, bitwise: two micro-batches accumulated unsharded, one reduction."""
    want = per_rank_reference(2, steps=4, micro=2)
    results = run_threaded(lambda r, w: train_sharded(r, w, steps=4, micro=2), 2, timeout=300)
    check_bitwise(results, want, "accumulation")


def _accumulate(rank: int, world: int, impl: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_stack(api, model, mp_policy=mp)
    micro = 3
    for m in range(micro):
        model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
        model(data(rank, m).to(torch.bfloat16)).sum().backward()
    return full_grads(model)


def _bf16_reference(world: int) -> dict[str, torch.Tensor]:
    """One process: each microbatch's bf16 gradient on a bf16 copy, accumulated in fp32 in
    microbatch order per rank slice, then the mean over ranks."""
    torch.set_num_threads(1)
    model = make(Stack).to(torch.bfloat16)
    total: dict[str, torch.Tensor] = {}
    for rank in range(world):
        acc: dict[str, torch.Tensor] = {}
        for m in range(3):
            model.zero_grad(set_to_none=True)
            model(data(rank, m).to(torch.bfloat16)).sum().backward()
            for name, p in model.named_parameters():
                assert p.grad is not None
                g = p.grad.float()
                acc[name] = g if name not in acc else acc[name] + g
        for name, g in acc.items():
            total[name] = g if name not in total else total[name] + g
    return {name: g * (1.0 / world) for name, g in total.items()}


def test_no_sync_accumulation_runs_in_reduce_dtype() -> None:
    """bf16 compute with fp32 reduction: microbatches without gradient sync accumulate the
    unsharded gradients in fp32 (not bf16), and the synced reduction runs in fp32: the result
    equals the fp32 accumulation of the bf16 microbatch gradients, bitwise, like FSDP2."""
    with recording_reduce_scatter() as seen:
        ours = run_threaded(_accumulate, 2, "ours")[0]
    theirs = run_threaded(_accumulate, 2, "fsdp2")[0]
    want = _bf16_reference(2)
    assert seen and all(dtype == torch.float32 for _, dtype in seen), seen
    for name, grad in ours.items():
        assert grad is not None and torch.equal(grad, want[name]), name
        assert torch.equal(grad, theirs[name]), name  # type: ignore[arg-type]
