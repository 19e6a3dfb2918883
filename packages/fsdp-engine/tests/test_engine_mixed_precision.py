"""Dtypes: the mixed-precision policy (bf16 compute, its reduce dtype), dtype conversions after
fully_shard, and parameters of several dtypes in one call, like FSDP2.

Numeric kind of every value comparison here: *same arithmetic* (same kernels on the same
unsharded values, one thread per rank, a two-rank mean is a two-term sum times 1/2): bitwise.
(Accumulation in the reduce dtype: ``test_engine_accumulation.py``.)
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    ALL_GATHER,
    ENGINES,
    Stack,
    counting,
    data,
    engine,
    full_params,
    make,
    recording_reduce_scatter,
    shard_stack,
)
from engine_training import check_bitwise, train_sharded
from torch import nn

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def test_bf16_mixed_precision_matches_torch_fsdp2() -> None:
    """Same arithmetic as torch's FSDP2 with bf16 compute and fp32 reduction: both cast the fp32
    shards to bf16 the same way, run the same bf16 kernels, and reduce in fp32: bitwise."""
    kwargs = {"steps": 6, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    ours = run_threaded(lambda r, w: train_sharded(r, w, engine="ours", **kwargs), 2, timeout=300)
    theirs = run_threaded(
        lambda r, w: train_sharded(r, w, engine="fsdp2", **kwargs), 2, timeout=300
    )
    check_bitwise(ours, theirs, "bf16 vs FSDP2")


def _convert(rank: int, world: int, impl: str, how: str, swap: bool) -> Any:
    torch.set_num_threads(1)
    torch.__future__.set_swap_module_params_on_conversion(swap)
    api = engine(impl)
    model = make(Stack)
    shard_stack(api, model)
    getattr(model, how)() if how != "to64" else model.to(torch.float64)
    dtype = {"to64": torch.float64, "double": torch.float64, "bfloat16": torch.bfloat16}[how]
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        loss = model(data(rank, step).to(dtype)).sum()
        loss.backward()
        for p in model.parameters():
            assert p.dtype == p.to_local().dtype == p._spec.tensor_meta.dtype == dtype  # type: ignore[union-attr]
            assert p.grad is not None and p.grad.dtype == p.grad.to_local().dtype == dtype
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        losses.append(loss.detach())
    return losses, full_params(model)


@pytest.mark.parametrize("how", ["to64", "double", "bfloat16"])
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "set-data"])
def test_dtype_conversion_after_fully_shard_converts_the_shards(how: str, swap: bool) -> None:
    """``.to(dtype)``/``.double()``/``.bfloat16()`` after fully_shard convert the sharded
    storage (parameter, local tensor and DTensor metadata agree), whichever way torch applies
    the conversion; training then matches FSDP2 bitwise."""
    try:
        ours = run_threaded(_convert, 2, "ours", how, swap)
        theirs = run_threaded(_convert, 2, "fsdp2", how, swap)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for (l1, p1), (l2, p2) in zip(ours, theirs, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(l1, l2, strict=True)), (l1, l2)
        assert all(torch.equal(p1[k], p2[k]) for k in p2)


def _clamp(rank: int, world: int, impl: str) -> list[tuple[int, torch.dtype]]:
    api = engine(impl)
    model = make(lambda: nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(torch.bfloat16))
    mp = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for layer in model:
        api.fully_shard(layer, mp_policy=mp)
    api.fully_shard(model, mp_policy=mp)
    model.to(torch.float32)
    model(data(rank)).sum().backward()
    return [p.dtype for p in model.parameters()]  # type: ignore[return-value]


def test_reduce_dtype_of_the_policy_survives_a_conversion() -> None:
    """A bf16 model with bf16 reduction, converted to fp32 after fully_shard: parameters are
    fp32 and the reduce-scatter still runs in bf16 (the policy's dtype)."""
    for impl in ENGINES:
        with recording_reduce_scatter() as seen:
            dtypes = run_threaded(_clamp, 2, impl)
        assert all(d == torch.float32 for d in dtypes[0]), (impl, dtypes)
        assert seen and all(dtype == torch.bfloat16 for _, dtype in seen), (impl, seen)


def _mixed(rank: int, world: int) -> dict[str, Any]:
    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.table = nn.Parameter(torch.randn(16, 8).to(torch.float16), requires_grad=False)
            self.codes = nn.Parameter(
                torch.zeros(32, 8, dtype=torch.float8_e4m3fn), requires_grad=False
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.table[:4].float() + self.codes[:4].float()

    model = make(Model)
    engine("ours").fully_shard(model)
    with counting() as counts:
        model(data(rank)).sum().backward()
    return {
        "gathers": counts.get(ALL_GATHER, 0),
        "groups": len(model.shard_plans()),  # type: ignore[operator]
        "dtypes": {n: p.dtype for n, p in model.named_parameters()},
        "grads": {n: p.grad is not None for n, p in model.named_parameters()},
    }


def test_parameters_of_several_dtypes_in_one_call() -> None:
    """One fully_shard call over fp32, fp16 and fp8 parameters: one group (one all-gather) per
    dtype, each parameter keeps its dtype, the trainable ones get gradients."""
    result = run_threaded(_mixed, 2)[0]
    assert result["gathers"] == 3 and result["groups"] == 3, result
    assert result["dtypes"]["codes"] == torch.float8_e4m3fn, result
    assert result["grads"] == {"lin.weight": True, "lin.bias": True, "table": False, "codes": False}
