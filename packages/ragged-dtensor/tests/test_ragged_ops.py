"""Ops, optimizers and gradient clipping on RaggedShard DTensors, against single-process results.

Numerics: elementwise ops are the same arithmetic per element (compared bitwise). Reductions
(sum, norms) are different arithmetic: the ranks' partial results are combined in another order
than one process's sum. Summing n terms in two orders differs by at most (n - 1) * eps * sum|x|
(u = eps / 2 per add, each order), so ``_sum_bound`` allows (n + 1) * eps * sum|x|; norms of
non-negative terms are relative: ``_norm_rtol`` = (n + 2) * eps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
from ragged_reference import reference_local
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ragged_dtensor import (
    RaggedOpError,
    RaggedShard,
    distribute_tensor,
    hooks_installed,
    strict_mode,
)
from ragged_dtensor.testing import count_collectives, run_threaded

pytestmark = pytest.mark.numerics


EPS32 = torch.finfo(torch.float32).eps


def _sum_bound(x: torch.Tensor) -> float:
    return (x.numel() + 1) * EPS32 * x.abs().sum().item()


def _norm_rtol(x: torch.Tensor) -> float:
    return (x.numel() + 2) * EPS32


def test_a_raggedshard_installs_every_part_of_the_integration() -> None:
    RaggedShard((0,), (1, 1))
    assert hooks_installed() == {
        "redistribute": True,
        "propagator": True,
        "checkpoint": True,
        "random": True,
        "distribute_tensor": True,
        "state_dict": True,
        "custom_handlers": True,
    }


def _units(world: int) -> tuple[int, ...]:
    return {1: (3,), 2: (1, 2), 3: (0, 2, 1), 4: (1, 0, 1, 1)}[world]


def _elementwise_body(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)  # threads share torch's global generator
    a, b = torch.randn(6, 5, generator=gen), torch.randn(6, 5, generator=gen)
    p = RaggedShard((0,), _units(world))
    da, db = distribute_tensor(a, mesh, [p]), distribute_tensor(b, mesh, [p])
    cases: list[tuple[DTensor, torch.Tensor]] = [
        (da + db, a + b),
        (da * 3.0 - db.exp(), a * 3.0 - b.exp()),
        (torch.where(da > 0, da, db), torch.where(a > 0, a, b)),
        (da.clone().mul_(2).add_(db, alpha=0.5), a * 2 + 0.5 * b),
        (torch.lerp(da, db, 0.25), torch.lerp(a, b, 0.25)),
        (da.to(torch.float64), a.to(torch.float64)),
        (torch.zeros_like(da) + 1, torch.ones_like(a)),
        # a Replicate operand of the same shape is sliced, a Replicate scalar broadcasts
        (da + distribute_tensor(b, mesh, [Replicate()]), a + b),
        (da * distribute_tensor(torch.tensor(3.0), mesh, [Replicate()]), a * 3),
    ]
    for got, want in cases:
        assert got.placements == (p,), got.placements
        torch.testing.assert_close(got.full_tensor(), want, rtol=0, atol=0)
    outs = torch._foreach_mul([da, db], 2.0)
    for got, want in zip(outs, [a * 2, b * 2], strict=True):
        assert got.placements == (p,)
        assert torch.equal(got.full_tensor(), want)
    # reductions: sum -> Partial, norms -> the p-norm partial, no communication until asked
    with count_collectives() as counter:
        s = da.sum()
        n = torch.linalg.vector_norm(da, 3)
        norms = torch._foreach_norm([da, db])
    assert counter.total == 0
    assert s.placements == (Partial(),)
    torch.testing.assert_close(s.full_tensor(), a.sum(), rtol=0, atol=_sum_bound(a))
    torch.testing.assert_close(
        n.full_tensor(), torch.linalg.vector_norm(a, 3), rtol=_norm_rtol(a), atol=0
    )
    for got, want, x in zip(norms, [a.norm(), b.norm()], [a, b], strict=True):
        torch.testing.assert_close(got.full_tensor(), want, rtol=_norm_rtol(x), atol=0)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_elementwise_ops_keep_the_layout(world: int) -> None:
    run_threaded(_elementwise_body, world)


def _replicated(like: DTensor, value: torch.Tensor) -> DTensor:
    return DTensor.from_local(value, like.device_mesh, [Replicate()], run_check=False)


# ops with no ragged rule: the fallback redistributes (strict mode: RaggedOpError)
_NO_RULE: list[tuple[str, Callable[[Any], Any]]] = [
    ("aten.t", lambda d: d.t()),
    ("aten.slice", lambda d: d[1:3]),
    ("aten.select", lambda d: d[0]),
    # (sums and norms over some dims of any share: test_ragged_rowwise_random.py)
    ("aten.prod", lambda d: d.prod(dim=1)),
    ("aten.cat", lambda d: torch.cat([d, d])),
    ("aten.var", lambda d: d.var(dim=0)),
    # in place: run on the replicated copy, this rank's share written back
    (
        "aten.index_fill_",
        lambda d: d.index_fill_(0, _replicated_like(d, torch.tensor([0, 4])), -1.0),
    ),
]
# ops with a ragged rule that moves nothing (strict mode runs them too)
_RULED: list[tuple[str, Callable[[Any], Any]]] = [
    ("view", lambda d: d.view(2, 15)),
    ("reshape", lambda d: d.reshape(30)),
    ("mean", lambda d: d.mean()),
    ("mm", lambda d: d @ _replicated_like(d, torch.arange(10.0).reshape(5, 2))),
    ("broadcast", lambda d: d + _replicated_like(d, torch.arange(5.0))),
]


def _replicated_like(like: Any, value: torch.Tensor) -> Any:
    if isinstance(like, DTensor):
        return DTensor.from_local(value, like.device_mesh, [Replicate()], run_check=False)
    return value


def _no_rule_body(rank: int, world: int, index: int, strict: bool) -> str:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(30.0).reshape(6, 5)
    d = distribute_tensor(full, mesh, [RaggedShard((0,), (1, 2))])
    _, fn = _NO_RULE[index]
    try:
        if strict:
            with strict_mode():
                fn(d)
        else:
            before = d.placements
            got = fn(d)
            torch.testing.assert_close(got.full_tensor(), fn(full), rtol=0, atol=0)
            if _NO_RULE[index][0].endswith("_"):  # in place: the same tensor, still ragged
                assert got is d and d.placements == before, d.placements
    except Exception as exc:  # the error type torch wraps ours in varies by path
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("index", range(len(_NO_RULE)), ids=[n for n, _ in _NO_RULE])
def test_ops_without_a_rule_redistribute_or_raise_in_strict_mode(
    index: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Without strict mode an op with no ragged rule gives the single-process result (its
    ragged operand redistributed, one debug line naming the op and the redistribution); in
    strict mode it raises RaggedOpError naming the op and the placement."""
    name, _ = _NO_RULE[index]
    with caplog.at_level(logging.DEBUG, logger="ragged_dtensor.fallback"):
        assert run_threaded(_no_rule_body, 2, index, False) == ["no error", "no error"]
    lines = [r.getMessage() for r in caplog.records if r.name == "ragged_dtensor.fallback"]
    assert any(name in line and "-> (Replicate())" in line for line in lines), lines
    message = run_threaded(_no_rule_body, 2, index, True)[0]
    assert name in message and "strict mode" in message, message
    assert "RaggedShard(dims=(0,), local_units=(1, 2))" in message, message


def _ruled_body(rank: int, world: int, index: int) -> tuple[str, int]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(30.0).reshape(6, 5)
    d = distribute_tensor(full, mesh, [RaggedShard((0,), (1, 2))])
    _, fn = _RULED[index]
    with strict_mode(), count_collectives() as counter:
        got = fn(d)
    torch.testing.assert_close(got.full_tensor(), fn(full), rtol=1e-6, atol=0)
    return str(got.placements), counter.total


@pytest.mark.parametrize("index", range(len(_RULED)), ids=[n for n, _ in _RULED])
def test_ops_with_a_ragged_rule_move_nothing_even_in_strict_mode(index: int) -> None:
    """Reshapes keep the flat share, row-wise matmul keeps the rows, a mean is a Partial, a
    broadcast operand is cut to the share: no collective, and the single-process result
    (mean: a reordered sum, rtol 1e-6 for 30 terms)."""
    placements, collectives = run_threaded(_ruled_body, 2, index)[0]
    assert collectives == 0, placements
    assert "Replicate" not in placements, placements


def test_ragged_op_error_is_public() -> None:
    assert issubclass(RaggedOpError, NotImplementedError)


def _optimizer_body(rank: int, world: int, kind: str) -> float:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)  # threads share torch's global generator
    shapes = [(8, 3), (5,), (4, 2, 3)]
    placements = [
        RaggedShard((0,), (1, 3) if world == 2 else (2, 2, 0, 4)),
        RaggedShard((0,), (0, 5) if world == 2 else (1, 2, 2, 0)),
        RaggedShard((0, 1), (1, 7) if world == 2 else (0, 4, 1, 3)),
    ]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    makers: dict[str, Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = {
        "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, foreach=True),
        "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.1, fused=True),
        "adamw_loop": lambda ps: torch.optim.AdamW(ps, lr=0.1, foreach=False),
        "sgd_foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
        "sgd_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    }
    ref = [torch.nn.Parameter(t.clone()) for t in init]
    dist_params = [
        torch.nn.Parameter(distribute_tensor(t.clone(), mesh, [p]))
        for t, p in zip(init, placements, strict=True)
    ]
    opt_ref, opt_dist = makers[kind](ref), makers[kind](dist_params)
    for step_grads in grads:
        for p, g in zip(ref, step_grads, strict=True):
            p.grad = g.clone()
        for p, g, pl in zip(dist_params, step_grads, placements, strict=True):
            p.grad = distribute_tensor(g.clone(), mesh, [pl])
        total_ref = torch.nn.utils.clip_grad_norm_(ref, 1.0)
        total_dist = torch.nn.utils.clip_grad_norm_(dist_params, 1.0)
        everything = torch.cat([g.reshape(-1) for g in step_grads])
        rtol = _norm_rtol(everything)
        torch.testing.assert_close(total_dist.full_tensor(), total_ref, rtol=rtol, atol=0)
        opt_ref.step()
        opt_dist.step()
    worst = 0.0
    for a, d, pl in zip(ref, dist_params, placements, strict=True):
        assert d.placements == (pl,)
        local = reference_local(a.detach(), (world,), [pl], rank)
        worst = max(worst, (d.to_local() - local).abs().max().item() if local.numel() else 0.0)
    return worst


@pytest.mark.parametrize(
    "kind", ["adamw_foreach", "adamw_fused", "adamw_loop", "sgd_foreach", "sgd_fused"]
)
@pytest.mark.parametrize("world", [2, 4])
def test_torch_optimizers_and_clip_grad_norm_match_single_process(kind: str, world: int) -> None:
    # Identical arithmetic per element; the one difference is clip_grad_norm_'s total norm, summed
    # across ranks in another order: relatively off by <= (n + 2) * eps (n = 39 gradient
    # entries), and so is each clipped gradient. AdamW's update is scale-free and SGD's is
    # lr * |g| <= 0.1 * 4: over 5 steps the parameters (|p| < 5) may differ by that relative
    # error of the update plus an ulp of |p| per step.
    worst = max(run_threaded(_optimizer_body, world, kind))
    n, steps = 8 * 3 + 5 + 4 * 2 * 3, 5
    bound = steps * ((n + 2) * EPS32 * 0.1 * 4 + 2 * EPS32 * 5)
    assert worst <= bound, (worst, bound)


_ORDERS = [float("inf"), float("-inf"), 0.0, 1.0, 2.0, 3.0]


def _norms_body(rank: int, world: int) -> list[tuple[str, float, torch.Tensor, torch.Tensor]]:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(2)  # threads share torch's global generator
    shapes = [(8, 3), (5,), (4, 2, 3)]
    placements = [  # every rank holds nothing of some tensor
        RaggedShard((0,), (2, 2, 0, 4)),
        RaggedShard((0,), (1, 0, 4, 0)),
        RaggedShard((0, 1), (0, 4, 1, 3)),
    ]
    full = [torch.randn(s, generator=gen) for s in shapes]
    full[1][2] = 0.0  # an exact zero: the 0-"norm" counts non-zeros
    parts = [distribute_tensor(t, mesh, [p]) for t, p in zip(full, placements, strict=True)]
    assert any(d.to_local().numel() == 0 for d in parts)
    out = []
    for order in _ORDERS:
        out.append(
            (
                "vector_norm",
                order,
                torch.linalg.vector_norm(parts[0], order).full_tensor(),
                torch.linalg.vector_norm(full[0], order),
            )
        )
        for got, want in zip(
            torch._foreach_norm(parts, order), torch._foreach_norm(full, order), strict=True
        ):
            out.append(("_foreach_norm", order, got.full_tensor(), want))
        grads = [torch.nn.Parameter(torch.zeros_like(t)) for t in full]
        dist_grads = [torch.nn.Parameter(torch.zeros_like(d)) for d in parts]
        for g, t in zip(grads, full, strict=True):
            g.grad = t.clone()
        for g, d in zip(dist_grads, parts, strict=True):
            g.grad = d.clone()
        want = torch.nn.utils.clip_grad_norm_(grads, 1.0, norm_type=order)
        got = torch.nn.utils.clip_grad_norm_(dist_grads, 1.0, norm_type=order)
        out.append(("clip_grad_norm_", order, got.full_tensor(), want))
        for g, d in zip(grads, dist_grads, strict=True):
            out.append(("clipped", order, d.grad.full_tensor(), g.grad))  # type: ignore[union-attr]
    return out


def test_norms_of_every_order_with_empty_shares_match_single_process() -> None:
    """[Note: norms without an identity] in ops.py: ``linalg_vector_norm``, ``_foreach_norm`` and
    ``clip_grad_norm_`` of every order, ``inf`` and ``-inf`` included, on tensors some rank holds
    no element of, equal one process's results on every rank (torch raises on the empty share
    for +-inf; FSDP2 does too when a Shard(0) share is empty). inf, -inf and 0 are a max, a min
    and a count (exact: bitwise, and so are the gradients they clip); the p-norms combine
    per-rank sums (relative error <= (n + 2) * eps, ``_norm_rtol``, for the norm and each
    clipped gradient)."""
    rtol = _norm_rtol(torch.empty(8 * 3 + 5 + 4 * 2 * 3))
    for rank_results in run_threaded(_norms_body, 4):
        assert len(rank_results) == len(_ORDERS) * (1 + 3 + 1 + 3)
        for what, order, got, want in rank_results:
            if order in (float("inf"), float("-inf"), 0.0):
                assert torch.equal(got, want), (what, order, got, want)
            else:
                torch.testing.assert_close(got, want, rtol=rtol, atol=0)


def _autograd_body(rank: int, world: int) -> list[float]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    weight = torch.linspace(-1, 1, 24).reshape(6, 4)
    p = RaggedShard((0,), _units(world))
    x = distribute_tensor(full, mesh, [p]).requires_grad_()
    with count_collectives() as counter:
        y = x.full_tensor()
        loss = (y * weight).sum()
        forward_calls = counter.total
        loss.backward()
    # forward: one all-gather; backward of RaggedShard -> Replicate: a local slice
    assert forward_calls == 1 and counter.total == 1, counter.calls
    assert x.grad is not None and x.grad.placements == (p,)
    assert torch.equal(x.grad.to_local(), reference_local(weight, (world,), [p], rank))
    # Partial gradient flowing back into a ragged tensor: one reduce-scatter
    z = distribute_tensor(full, mesh, [p]).requires_grad_()
    out = z.redistribute(mesh, [Shard(1)])
    (out.to_local() * 2).sum().backward()
    assert torch.equal(z.grad.full_tensor(), torch.full((6, 4), 2.0))  # type: ignore[union-attr]
    return z.grad.to_local().tolist()  # type: ignore[union-attr,no-any-return]


@pytest.mark.parametrize("world", [2, 3])
def test_autograd_through_redistribution(world: int) -> None:
    run_threaded(_autograd_body, world)


def _rowwise_body(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(6, 5, 3, generator=gen)
    p = RaggedShard((0,), _units(world))
    d = distribute_tensor(full, mesh, [p])
    rows = tuple(u * 2 for u in p.local_units)  # 6 rows / 3 units: 2 rows per unit
    cases: list[tuple[DTensor, torch.Tensor]] = [
        (torch.linalg.vector_norm(d, dim=(1, 2)), torch.linalg.vector_norm(full, dim=(1, 2))),
        (torch.linalg.vector_norm(d, 3, dim=-1), torch.linalg.vector_norm(full, 3, dim=-1)),
        (d.sum(dim=1), full.sum(dim=1)),
        (d.mean(dim=(1, 2)), full.mean(dim=(1, 2))),
        (d.amax(dim=2), full.amax(dim=2)),
    ]
    with count_collectives() as counter:
        locals_ = [got.to_local() for got, _ in cases]
    assert counter.total == 0
    for (got, want), local in zip(cases, locals_, strict=True):
        assert got.placements == (RaggedShard((0,), rows),), got.placements
        # a ragged local tensor is flat: the rank's rows of the result, row-major
        assert local.shape == (rows[rank] * want[0].numel(),), local.shape
        # same arithmetic: each row's reduction runs whole on one rank, the same kernel
        assert torch.equal(got.full_tensor(), want)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rowwise_reductions_stay_ragged_without_communication(world: int) -> None:
    run_threaded(_rowwise_body, world)
