"""The aligned pass finds the smallest shard size that fits without a greedy per ``align`` step:
equal to the previous pass where that one kept the method's size, never larger elsewhere, the
smallest size over its orders, and one test of a shard size when every block divides the
alignment."""

from __future__ import annotations

import math

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_testing import FUZZ_EXAMPLES, check_plan_independently, groups

import shard_planner as sp
from shard_planner._private import align as align_mod
from shard_planner._private.align import aligned_end, aligned_greedy, aligned_plan
from shard_planner._private.bounds import round_up
from shard_planner._private.orders import static_orders

SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
Case = tuple[list[sp.TensorSpec], int, int]


def _orders(p: sp.Plan) -> list[tuple[int, ...]]:
    nonempty = [i for i in p.order if p.numels[i] > 0]
    empty = [i for i in p.order if p.numels[i] == 0]
    rest = [(*o, *empty) for o in static_orders(p.numels, p.blocks, nonempty)]
    return [p.order, *rest]


def _previous_pass(p: sp.Plan, a: int) -> sp.Plan:
    """The pass as it was before (test reference only): every order at the method's size, then
    the size grown by at least one ``align`` per round, a full greedy per order per round."""
    if all(off % a == 0 for off in p.offsets):
        return attrs.evolve(p, offset_align=a)
    numels, blocks, m = p.numels, p.blocks, p.world_size
    orders = _orders(p)
    shard = p.shard_size
    trivial = round_up(sum(numels) + len(numels) * a, p.align)
    offsets = None
    while offsets is None:
        best = None
        for order in orders:
            offsets, end = aligned_greedy(numels, blocks, order, shard, m, a)
            if offsets is not None:
                break
            best = end if best is None else min(best, end)
        if offsets is None:
            assert best is not None and shard < trivial
            shard = min(max(shard + p.align, round_up(-(-best // m), p.align)), trivial)
    full = tuple(offsets[i] for i in range(len(numels)))
    return sp.Plan(
        world_size=m,
        shard_size=shard,
        align=p.align,
        numels=numels,
        blocks=blocks,
        names=p.names,
        offsets=full,
        order=tuple(sorted(range(len(numels)), key=lambda i: (full[i], numels[i] > 0, i))),
        method=p.method,
        optimal=p.optimal and shard == p.shard_size,
        offset_align=a,
    )


def _fits(p: sp.Plan, shard: int, a: int) -> bool:
    return any(
        aligned_greedy(p.numels, p.blocks, o, shard, p.world_size, a)[0] is not None
        for o in _orders(p)
    )


@SETTINGS
@given(groups(), st.sampled_from([1, 2, 4, 8]), st.sampled_from(sp.METHODS))
def test_property_pass_matches_or_beats_the_previous_one(
    case: Case, factor: int, method: str
) -> None:
    """Against the previous pass on the same method's plan: identical where it kept the
    method's size; otherwise valid and never larger; and no size between the method's and the
    result fits with any of the orders (the result is the smallest, by brute force)."""
    specs, world, align = case
    if method == "exact" and sum(s.numel > 0 for s in specs) > sp.MAX_EXACT_TENSORS:
        method = "auto"
    a = align * factor
    free = sp.plan(specs, world, a, method=method)
    new = aligned_plan(free, a)
    old = _previous_pass(free, a)
    new.validate()
    check_plan_independently(new, specs)
    assert all(off % a == 0 for off in new.offsets)
    if old.shard_size == free.shard_size:
        assert new == old and new.offsets == old.offsets and new.optimal == old.optimal
    else:
        assert new.shard_size <= old.shard_size
        assert not new.optimal
    for shard in range(free.shard_size, new.shard_size, a):
        assert not _fits(free, shard, a), f"{shard} fits, below the result {new.shard_size}"


@SETTINGS
@given(groups(), st.sampled_from([1, 2, 4, 8]), st.integers(0, 40))
def test_property_fast_end_equals_the_greedy(case: Case, factor: int, steps: int) -> None:
    """``aligned_end`` (a bisection per boundary event) says what the per-tensor greedy says,
    at every size from the plan's upwards, for every order."""
    specs, world, align = case
    a = align * factor
    free = sp.plan(specs, world, a)
    numels, blocks = free.numels, free.blocks
    for order in _orders(free):
        run = align_mod._Run.of(numels, blocks, order, a)
        for shard in range(free.shard_size, free.shard_size + (steps + 1) * a, a):
            offsets, end = aligned_greedy(numels, blocks, order, shard, world, a)
            fast, events = aligned_end(run, shard, world, a)
            assert events <= world + 1
            if offsets is None:
                assert fast is None
            else:
                assert fast == end


def test_feasibility_is_not_monotone() -> None:
    """The reason the pass does not bisect on "fits": 12 elements of block 4 over 3 ranks fit at
    S = 4 and 8, not at 5, 6 or 7 (each would need a cut inside a block)."""
    run = align_mod._Run.of([12], [4], [0], 1)
    fits = [aligned_end(run, s, 3, 1)[0] is not None for s in range(4, 10)]
    assert fits == [True, False, False, False, True, True]


def test_blocks_dividing_the_alignment_take_one_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """5,000 ``Linear(2, 2)`` (weights of 4, biases of 2 elements) at 2 ranks, 16-byte fp32
    starts: the closed form gives the size directly, one ``aligned_end`` per order tried at the
    method's size plus one at the answer (the previous pass ran 5,001 rounds of greedies)."""
    specs = [sp.TensorSpec(4 if i % 2 == 0 else 2) for i in range(10_000)]
    free = sp.plan(specs, 2, 4)
    calls = []
    real = align_mod.aligned_end

    def counting(*args: object, **kwargs: object) -> tuple[int | None, int]:
        calls.append(args[1])
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(align_mod, "aligned_end", counting)
    p = aligned_plan(free, 4)
    p.validate()
    # Every weight of 4 and bias of 2 rounded up to 4: 40,000 elements, 20,000 a rank.
    assert p.shard_size == 20_000 == math.ceil((5_000 * 4 + 4_999 * 4 + 2) / 2 / 4) * 4
    assert sorted(set(calls)) == [free.shard_size, 20_000]
    assert calls.count(20_000) == 1


def test_bisection_past_the_budget_still_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no budget for the upward scan, the rest of the window is bisected: the result fits,
    the size just below it does not, and the plan is valid."""
    monkeypatch.setattr(align_mod, "WINDOW_BUDGET", -1)
    specs = [sp.TensorSpec(e * g, g) for e, g in [(3, 5), (7, 3), (1, 1), (9, 6), (5, 7)] * 6]
    for world in (2, 3, 5, 8):
        free = sp.plan(specs, world, 8)
        p = aligned_plan(free, 8)
        p.validate()
        check_plan_independently(p, specs)
        if p.shard_size > free.shard_size:
            assert not _fits(free, p.shard_size - 8, 8)
