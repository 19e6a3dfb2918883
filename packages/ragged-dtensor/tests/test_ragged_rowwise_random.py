"""Reductions over some dims of any ragged share, random ops on ragged DTensors, and foreach
lists mixing ragged and replicated tensors.

Numeric kinds. Max/min-type results (``amax``, ``amin``, the inf/-inf/0 "norms") and random
draws are *same arithmetic* and compared bitwise. Sums, means and p-norms (p = 1, 2, 3) are
*different arithmetic*: each rank sums its part of a row and the parts are combined, where one
process sums the row at once; for a row of n terms both are within gamma_n * sum|x| of the
exact sum (Higham, gamma_n = n eps / (1 - n eps), eps = 2**-24 in fp32), so they differ by at
most ``2 * gamma_n * sum|x|`` (for a p-norm, its relative error is bounded the same way with
``sum|x|^p``; we use the looser ``2 * gamma_(n+2) * norm + eps * norm``).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.distributed.tensor import init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate

from ragged_dtensor import RaggedOpError, RaggedShard, distribute_tensor, from_local, strict_mode
from ragged_dtensor.testing import count_collectives, run_threaded

pytestmark = pytest.mark.numerics

EPS = 2.0**-24


def _gamma(n: int) -> float:
    return n * EPS / (1 - n * EPS)


# (name, op, exact?, bound scale): the bound is 2 * gamma_n * scale(x) with n the number of
# reduced elements per output
Case = tuple[
    str, Callable[[torch.Tensor], torch.Tensor], bool, Callable[[torch.Tensor], torch.Tensor]
]
CASES: list[Case] = [
    ("sum dim 1", lambda t: t.sum(dim=1), False, lambda x: x.abs().sum(dim=1)),
    ("sum dim 0", lambda t: t.sum(dim=0), False, lambda x: x.abs().sum(dim=0)),
    (
        "mean dim 1 keepdim",
        lambda t: t.mean(dim=1, keepdim=True),
        False,
        lambda x: x.abs().mean(dim=1, keepdim=True),
    ),
    (
        "2-norm dim 1",
        lambda t: torch.linalg.norm(t, dim=1),
        False,
        lambda x: torch.linalg.norm(x, dim=1),
    ),
    (
        "1-norm dim 0",
        lambda t: torch.linalg.vector_norm(t, 1, dim=0),
        False,
        lambda x: x.abs().sum(dim=0),
    ),
    (
        "3-norm dim 1",
        lambda t: torch.linalg.vector_norm(t, 3, dim=1),
        False,
        lambda x: torch.linalg.vector_norm(x, 3, dim=1),
    ),
    (
        "inf-norm dim 1",
        lambda t: torch.linalg.vector_norm(t, float("inf"), dim=1),
        True,
        lambda x: x,
    ),
    (
        "-inf-norm dim 1",
        lambda t: torch.linalg.vector_norm(t, float("-inf"), dim=1),
        True,
        lambda x: x,
    ),
    ("0-norm dim 1", lambda t: torch.linalg.vector_norm(t, 0, dim=1), True, lambda x: x),
    ("amax dim 1", lambda t: t.amax(dim=1), True, lambda x: x),
    ("amin dim 0", lambda t: t.amin(dim=0), True, lambda x: x),
    ("inf-norm of all", lambda t: torch.linalg.vector_norm(t, float("inf")), True, lambda x: x),
]
# shares that cut rows (not boxes of whole dim-0 slices), and one of whole rows
LAYOUTS = {
    2: [RaggedShard((0, 1), (7, 8)), RaggedShard((0, 1), (0, 15)), RaggedShard((0,), (1, 2))],
    3: [RaggedShard((0, 1), (4, 0, 11))],
}


def _reduce_body(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.randn(3, 5, generator=torch.Generator().manual_seed(3))
    full[1, 2] = 0.0  # a zero for the 0-norm
    problems = []
    for placement in LAYOUTS[world]:
        d = distribute_tensor(full, mesh, [placement])
        for name, op, exact, scale in CASES:
            with count_collectives() as counter:
                got = op(d)
            assert counter.total == 0, name  # partial results, no communication yet
            value = got.full_tensor()
            want = op(full)
            if exact:
                ok = torch.equal(value, want)
            else:
                n = full.numel() // max(1, want.numel())
                limit = 2 * _gamma(n + 2) * scale(full) + EPS * want.abs()
                ok = value.shape == want.shape and bool(((value - want).abs() <= limit).all())
            if not ok:
                problems.append(f"{placement} {name}: {value} vs {want}")
    return problems


@pytest.mark.parametrize("world", [2, 3])
def test_reductions_over_some_dims_of_any_share(world: int) -> None:
    """Shares that cut rows: each rank reduces its share padded to the full tensor (with the
    reduction's identity) into a partial result, combined like torch's Shard partials."""
    for problems in run_threaded(_reduce_body, world):
        assert not problems, problems


def _placements_body(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(torch.randn(3, 5), mesh, [RaggedShard((0, 1), (7, 8))])
    return [
        repr(torch.linalg.norm(d, dim=1).placements[0]),
        repr(d.sum(dim=1).placements[0]),
        repr(d.amax(dim=0).placements[0]),
        repr(torch.linalg.vector_norm(d, float("inf"), dim=1).placements[0]),
    ]


def test_partial_placements_are_torchs() -> None:
    got = run_threaded(_placements_body, 2)[0]
    assert got == [
        "_NormPartial(2.0)",
        repr(Partial("sum")),
        repr(Partial("max")),
        repr(Partial("max")),
    ]


def _random_body(rank: int, world: int, placement: RaggedShard) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    problems = []
    shape = (6, 5)
    fills: list[tuple[str, Callable[[torch.Tensor, torch.Generator], object]]] = [
        ("uniform_", lambda t, g: t.uniform_(-2, 3, generator=g)),
        ("normal_", lambda t, g: t.normal_(1.0, 0.5, generator=g)),
        ("bernoulli_", lambda t, g: t.bernoulli_(0.3, generator=g)),
        ("kaiming_uniform_", lambda t, g: nn.init.kaiming_uniform_(t, a=5**0.5, generator=g)),
        ("trunc_normal_", lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g)),
    ]
    for name, fill in fills:
        d = distribute_tensor(torch.zeros(shape), mesh, [placement])
        fill(d, torch.Generator().manual_seed(11))  # the same seed on every rank
        want = torch.zeros(shape)
        fill(want, torch.Generator().manual_seed(11))
        if not torch.equal(d.full_tensor(), want):
            problems.append(name)
    like = distribute_tensor(torch.zeros(shape), mesh, [placement])
    for name, factory in (("rand_like", torch.rand_like), ("randn_like", torch.randn_like)):
        got = factory(like, generator=torch.Generator().manual_seed(5))
        want = factory(torch.zeros(shape), generator=torch.Generator().manual_seed(5))
        if got.placements != (placement,) or not torch.equal(got.full_tensor(), want):
            problems.append(name)
    return problems


@pytest.mark.parametrize(
    "placement",
    [RaggedShard((0, 1), (13, 17)), RaggedShard((0,), (0, 3)), RaggedShard((), (0, 1))],
    ids=["cut rows", "rank 0 empty", "one rank holds all"],
)
def test_random_fills_draw_what_one_device_draws(placement: RaggedShard) -> None:
    """A random op on a ragged DTensor draws the whole tensor from the generator one device
    would use and keeps this rank's share: same seed, same values, whatever the layout (no
    rank repeats another's numbers). Threads share torch's default generator, so this test
    passes explicit generators; the default-generator path is tested on processes in
    fsdp-engine's test_engine_random_init.py."""
    for problems in run_threaded(_random_body, 2, placement):
        assert not problems, problems


def _random_errors(rank: int, world: int) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    d = distribute_tensor(torch.full((4, 4), 0.5), mesh, [RaggedShard((0,), (1, 1))])
    out = []
    for fn in (torch.bernoulli, lambda t: torch.nn.functional.dropout(t, 0.5)):
        try:
            fn(d)
        except Exception as exc:  # torch may wrap ours
            out.append(type(exc).__name__ + ": " + str(exc).splitlines()[0])
    meta = from_local(
        torch.empty(8, device="meta"), mesh, [RaggedShard((0,), (1, 1))], shape=torch.Size((4, 4))
    )
    meta.uniform_()  # nothing to draw on meta
    return out


def test_random_ops_that_read_values_raise() -> None:
    for message in run_threaded(_random_errors, 2)[0]:
        assert "random op reads the whole tensor" in message or "RaggedOpError" in message, message


def _foreach_body(rank: int, world: int) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 3, generator=gen), torch.randn(5, generator=gen)
    ragged = distribute_tensor(a, mesh, [RaggedShard((0, 1), (5, 7))])
    replicated = distribute_tensor(b, mesh, [Replicate()])
    out = torch._foreach_sqrt([ragged.abs(), replicated.abs()])
    return (
        out[0].placements == ragged.placements
        and out[1].placements == (Replicate(),)
        and torch.equal(out[0].full_tensor(), a.abs().sqrt())
        and torch.equal(out[1].full_tensor(), b.abs().sqrt())
    )


def test_foreach_lists_mixing_ragged_and_replicated_tensors() -> None:
    """An optimizer over ragged parameters and replicated ones (e.g. ``replicate()`` beside
    fully_shard) runs one foreach op over both."""
    assert all(run_threaded(_foreach_body, 2))


def test_a_negative_order_norm_over_some_dims_redistributes_or_raises_in_strict_mode() -> None:
    """A negative-order norm has no padding identity: without strict mode the share is
    redistributed (the single-process result), in strict mode RaggedOpError names the order."""

    def body(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (world,))
        full = torch.arange(1.0, 16.0).reshape(3, 5)
        d = distribute_tensor(full, mesh, [RaggedShard((0, 1), (7, 8))])
        got = torch.linalg.vector_norm(d, -2.0, dim=1)
        torch.testing.assert_close(
            got.full_tensor(), torch.linalg.vector_norm(full, -2.0, dim=1), rtol=0, atol=0
        )
        try:
            with strict_mode():
                torch.linalg.vector_norm(d, -2.0, dim=1)
        except Exception as exc:
            return str(exc)
        return "no error"

    assert "norm of order -2.0" in run_threaded(body, 2)[0]
    assert issubclass(RaggedOpError, NotImplementedError)
