"""Conditional compute on real gloo processes: a branch skipped on some ranks, a mixture of
experts whose experts get tokens on some ranks only (experts without tokens are skipped), and a
block that runs twice per forward (its group reduces twice in one backward), each for two steps,
with and without gradient accumulation, at world sizes 2 and 4.

A rank that does not use a parameter contributes zeros to its group's reduction ([Note:
conditional compute] in fsdp_engine's group.py), so every rank issues the same collectives and
nothing hangs (a hard timeout would fail the test); after backward every parameter has the same
``.grad`` presence on every rank, and the values are one process's gradient of the mean loss.
Presence: by default every trainable parameter of a reduced group keeps a ``.grad`` (zeros for
one no rank used); with ``set_reduce_scatter_unused_params(False)`` those lose it, exactly as
with one process (one extra small all-reduce per backward).

Numeric kinds (see engine_conditional.run_case): at world size 2, *same arithmetic* (bitwise:
per-slice gradients by the same kernels on one thread, a two-term sum, a power-of-two scale);
at world size 4, *different arithmetic* (gloo's summation order): each gradient within
``2 * gamma_3 * sum_r |g_r| / 4`` of the reference, gamma_3 = 3 eps / (1 - 3 eps), eps = 2**-24.
"""

from __future__ import annotations

import pytest
from engine_conditional import run_case

from ragged_dtensor.testing import run_processes

pytestmark = pytest.mark.numerics


def _all_cases(rank: int, world: int) -> dict[str, object]:
    return {
        f"{case}/micro{micro}/{'exact' if exact else 'kept'}": run_case(
            rank, world, case, micro, exact
        )
        for case in ("branch", "moe")
        for micro in (1, 2)
        for exact in (False, True)
    } | {"twice/micro1/kept": run_case(rank, world, "twice", 1, False)}


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, 4])
def test_conditional_compute_never_hangs_and_matches_one_process(world: int) -> None:
    results = run_processes(_all_cases, world, timeout=420)
    for rank, by_case in enumerate(results):
        for name, report in by_case.items():
            assert isinstance(report, dict)
            assert report["presence_same_on_every_rank"], (rank, name, report["presence"])
            assert not report["grad_errors"], (rank, name, report["grad_errors"])
            assert not report["param_errors"], (rank, name, report["param_errors"])
    # the cases do exercise what they claim: a parameter used on one rank only has a gradient
    # everywhere; one no rank uses has none anywhere
    presence = results[-1]  # the last rank: it does not use the branch nor expert 1
    branch = presence["branch/micro1/exact"]["presence"][0]  # type: ignore[index]
    assert branch["block.branch.weight"] and not branch["block.never.weight"]
    moe = presence["moe/micro1/exact"]["presence"]  # type: ignore[index]
    assert moe[0]["moe.experts.1.w1.weight"] and not moe[0]["moe.experts.3.w1.weight"]
    assert not moe[0]["moe.experts.2.w1.weight"]  # step 0: expert 2 has no token on any rank
    assert moe[1]["moe.experts.2.w1.weight"]
    kept = presence["moe/micro1/kept"]["presence"][0]  # type: ignore[index]
    assert all(kept.values())
