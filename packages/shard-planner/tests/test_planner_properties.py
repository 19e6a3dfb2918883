"""Hypothesis: every method's plan satisfies every invariant on random groups.

Example counts come from FUZZ_EXAMPLES (default 300; ``nox -s fuzz`` runs 10,000). Every
planning call must take under 1 s of CPU time (``time.process_time``: this process's own work,
so other jobs on a shared machine do not count).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from planner_testing import FUZZ_EXAMPLES, check_plan_independently, groups

import shard_planner as sp

Case = tuple[list[sp.TensorSpec], int, int]


def _within_a_second(fn: Callable[[], sp.Plan]) -> sp.Plan:
    start = time.process_time()
    p = fn()
    seconds = time.process_time() - start
    assert seconds < 1.0, f"planning took {seconds:.2f} s"
    return p


SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@SETTINGS
@given(groups())
def test_property_auto_plan_is_valid_bounded_and_deterministic(case: Case) -> None:
    specs, world, align = case
    p = _within_a_second(lambda: sp.plan(specs, world, align))
    p.validate()
    check_plan_independently(p, specs)
    assert p.shard_size >= sp.lower_bound(specs, world, align)
    for baseline in ("naive", "megatron", "paper"):
        assert p.shard_size <= sp.plan(specs, world, align, method=baseline).shard_size
    again = sp.plan(list(specs), world, align)
    assert again == p and hash(again) == hash(p) and again.fingerprint == p.fingerprint


@SETTINGS
@given(groups())
def test_property_every_method_is_valid(case: Case) -> None:
    specs, world, align = case
    for method in ("paper", "naive", "megatron", "model-order"):
        p = _within_a_second(lambda m=method: sp.plan(specs, world, align, method=m))
        p.validate()
        check_plan_independently(p, specs)


@SETTINGS
@given(groups(max_tensors=6, max_blocks=12))
def test_property_auto_matches_exact_on_tiny_groups(case: Case) -> None:
    specs, world, align = case
    exact = sp.exact_plan(specs, world, align)
    exact.validate()
    check_plan_independently(exact, specs)
    assert sp.lower_bound(specs, world, align) <= exact.shard_size
    # With at most 5040 distinct orders the fast planner checks them all: it must be optimal.
    assert sp.plan(specs, world, align).shard_size == exact.shard_size


@SETTINGS
@given(groups(max_tensors=12), st.sampled_from(["keep", "exact", "min"]), st.integers(0, 40))
def test_property_gap_filling_places_validly(case: Case, policy: str, extra: int) -> None:
    from shard_planner._private.bounds import lower_bound_shard_size
    from shard_planner._private.orders import fill_offsets, layout_fits

    specs, world, align = case
    numels = [s.numel for s in specs]
    blocks = [s.block for s in specs]
    shard = lower_bound_shard_size(numels, blocks, world, align) + extra * align
    offsets = fill_offsets(numels, blocks, range(len(specs)), shard, world, policy=policy)
    if offsets is None:
        return
    assert layout_fits(numels, blocks, offsets, shard, world)
    full = {i: offsets.get(i, 0) for i in range(len(specs))}
    order = sorted(range(len(specs)), key=lambda i: (full[i], numels[i] > 0, i))
    p = sp.Plan(
        world_size=world,
        shard_size=shard,
        align=align,
        numels=tuple(numels),
        blocks=tuple(blocks),
        names=tuple(s.name for s in specs),
        offsets=tuple(min(full[i], world * shard - 1) for i in range(len(specs))),
        order=tuple(order),
    )
    check_plan_independently(p, specs)
