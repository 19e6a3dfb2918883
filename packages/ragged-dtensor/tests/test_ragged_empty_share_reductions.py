"""Every reduction of a RaggedShard tensor with an empty local share gives one process's value.

A planned layout often gives a rank no element of a tensor. Each reduction below runs on a
tensor where rank 0 holds nothing (and, at 3 ranks, one in the middle), whole rows or not, and
every rank's result (gathered) is compared with the single-process value: exactly for max/min,
the inf norms, any/all, counts and argmax; within the summation-order bound for sums, means,
p-norms, variances and logsumexp (n + 2) * eps relative for n <= 24 terms, so rtol 1e-5.
``clip_grad_norm_`` with ``norm_type=inf`` over such parameters gives one process's total norm
and clipped gradients (issue 33 item 6).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, init_device_mesh

from ragged_dtensor import RaggedShard, distribute_tensor
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

INF = float("inf")

REDUCTIONS: dict[str, Callable[[Any], Any]] = {
    "sum": lambda x: x.sum(),
    "sum dims (0, 1)": lambda x: x.sum(dim=(0, 1)),
    "sum dim 1": lambda x: x.sum(dim=1),
    "sum dim 0 keepdim": lambda x: x.sum(dim=0, keepdim=True),
    "mean": lambda x: x.mean(),
    "mean dim 1 keepdim": lambda x: x.mean(dim=1, keepdim=True),
    "amax": lambda x: x.amax(),
    "amin dim 1": lambda x: x.amin(dim=1),
    "max": lambda x: x.max(),
    "min": lambda x: x.min(),
    "max dim 0": lambda x: x.max(dim=0).values,
    "prod": lambda x: x.prod(),
    "any": lambda x: (x > 1.5).any(),
    "all": lambda x: (x > -9).all(),
    "argmax": lambda x: x.argmax(),
    "count_nonzero": lambda x: torch.count_nonzero(x > 0),
    "var": lambda x: x.var(),
    "std dim 1": lambda x: x.std(dim=1),
    "logsumexp dim 1": lambda x: torch.logsumexp(x, dim=1),
    "norm 0": lambda x: torch.linalg.vector_norm(x, 0),
    "norm 1": lambda x: torch.linalg.vector_norm(x, 1),
    "norm 2": torch.linalg.vector_norm,
    "norm 3": lambda x: torch.linalg.vector_norm(x, 3),
    "norm inf": lambda x: torch.linalg.vector_norm(x, INF),
    "norm -inf": lambda x: torch.linalg.vector_norm(x, -INF),
    "norm inf dims (0, 1)": lambda x: torch.linalg.vector_norm(x, INF, dim=(0, 1)),
    "norm 2 dim 1": lambda x: torch.linalg.vector_norm(x, 2, dim=1),
    "frobenius": torch.linalg.matrix_norm,
    "foreach norm inf": lambda x: torch._foreach_norm([x], INF)[0],
    "foreach norm 2": lambda x: torch._foreach_norm([x], 2)[0],
}
EXACT = {
    "amax",
    "amin dim 1",
    "max",
    "min",
    "max dim 0",
    "any",
    "all",
    "argmax",
    "count_nonzero",
    "norm 0",
    "norm inf",
    "norm -inf",
    "norm inf dims (0, 1)",
    "foreach norm inf",
}

# (world, local_units, dims): rank 0 empty, whole rows; a rank empty, a flat share of rows
LAYOUTS = [
    (2, (0, 4), (0,)),
    (3, (1, 0, 3), (0,)),
    (3, (0, 5, 7), (0, 1)),
]


def _full() -> torch.Tensor:
    return torch.linspace(-2.0, 3.0, 12).reshape(4, 3).sin() * 2


def _reduce(rank: int, world: int, units: tuple[int, ...], dims: tuple[int, ...]) -> Any:
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(_full(), mesh, [RaggedShard(dims, units)])
    empty = x.to_local().numel() == 0
    out: dict[str, Any] = {}
    for name, fn in REDUCTIONS.items():
        got = fn(x)
        out[name] = got.full_tensor() if isinstance(got, DTensor) else got
    return empty, out


@pytest.mark.parametrize(("world", "units", "dims"), LAYOUTS)
def test_every_reduction_with_an_empty_share_gives_one_process_value(
    world: int, units: tuple[int, ...], dims: tuple[int, ...]
) -> None:
    results = run_threaded(_reduce, world, units, dims, timeout=120)
    assert any(empty for empty, _ in results)
    full = _full()
    for _, out in results:
        for name, fn in REDUCTIONS.items():
            want = fn(full)
            rtol = 0 if name in EXACT else 1e-5
            torch.testing.assert_close(out[name], want, rtol=rtol, atol=0, msg=name)


def _clip(rank: int, world: int) -> Any:
    mesh = init_device_mesh("cpu", (world,))
    full = [_full(), _full()[:1] * 5, torch.tensor([[0.5, -7.0, 1.0]])]
    placements = [(0, 4), (1, 0), (0, 1)]  # rank 0, then rank 1, hold nothing
    params = []
    for value, units in zip(full, placements, strict=True):
        p = torch.nn.Parameter(distribute_tensor(value.clone(), mesh, [RaggedShard((0,), units)]))
        p.grad = distribute_tensor(value.clone() * 2, mesh, [RaggedShard((0,), units)])
        params.append(p)
    total = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type=INF)
    return total.full_tensor(), [p.grad.full_tensor() for p in params]  # type: ignore[union-attr]


def test_clip_grad_norm_inf_with_empty_shares_gives_one_process_norm() -> None:
    refs = [
        torch.nn.Parameter(v.clone())
        for v in (_full(), _full()[:1] * 5, torch.tensor([[0.5, -7.0, 1.0]]))
    ]
    for r in refs:
        r.grad = r.detach() * 2
    want = torch.nn.utils.clip_grad_norm_(refs, 1.0, norm_type=INF)
    for total, grads in run_threaded(_clip, 2, timeout=120):
        assert torch.equal(total, want)
        for got, ref in zip(grads, refs, strict=True):
            torch.testing.assert_close(got, ref.grad, rtol=0, atol=0)
