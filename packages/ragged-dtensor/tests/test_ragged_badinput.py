"""Bad-input catalogue (RaggedShard placements and ops): the stated error type, a message naming
the offending placement, op or argument, never wrong data."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, init_device_mesh

from ragged_dtensor import RaggedOpError, RaggedShard, distribute_tensor, from_local, strict_mode
from ragged_dtensor.testing import expect_error_on_every_rank, run_threaded

FULL = torch.arange(32.0).reshape(8, 4)


def _ragged(mesh: Any, units: tuple[int, ...] = (1, 3)) -> DTensor:
    return distribute_tensor(FULL, mesh, [RaggedShard((0,), units)])


def _strict(fn: Callable[[], object]) -> object:
    with strict_mode():
        return fn()


Case = tuple[Callable[[Any], object], type[Exception], tuple[str, ...]]
CASES: dict[str, Case] = {
    "negative units": (
        lambda mesh: RaggedShard((0,), (-1, 3)),
        ValueError,
        ("local_units (-1, 3)", ">= 0"),
    ),
    "dims not a prefix": (
        lambda mesh: RaggedShard((1,), (1, 1)),
        ValueError,
        ("dims (1,)", "prefix"),
    ),
    "units summing to zero": (
        lambda mesh: distribute_tensor(FULL, mesh, [RaggedShard((0,), (0, 0))]),
        ValueError,
        ("local_units (0, 0)", "sum to 0"),
    ),
    "whole-tensor unit not one-hot": (
        lambda mesh: distribute_tensor(FULL, mesh, [RaggedShard((), (1, 1))]),
        ValueError,
        ("dims=()", "(1, 1)", "one-hot"),
    ),
    # ops with no ragged rule: the fallback redistributes; in strict mode they are refused
    "transpose (strict mode)": (
        lambda mesh: _strict(lambda: _ragged(mesh).t()),
        RaggedOpError,
        ("aten.t", "RaggedShard", "strict mode"),
    ),
    "slicing (strict mode)": (
        lambda mesh: _strict(lambda: _ragged(mesh)[1:3]),
        RaggedOpError,
        ("aten.slice", "RaggedShard", "strict mode"),
    ),
    "a product over some dims (strict mode)": (
        # (sums, means, norms, amax/amin over any dims are supported: partial results)
        lambda mesh: _strict(lambda: _ragged(mesh).prod(dim=0)),
        RaggedOpError,
        ("aten.prod", "RaggedShard", "strict mode"),
    ),
    "out= operand with no ragged rule": (
        lambda mesh: torch.cumsum(_ragged(mesh), 0, out=_ragged(mesh)),
        RaggedOpError,
        ("aten.cumsum", "RaggedShard", "ragged out= operand"),
    ),
    "redistribute: units for another world size": (
        lambda mesh: _ragged(mesh).redistribute(mesh, [RaggedShard((0,), (1, 1, 2))]),
        ValueError,
        ("(1, 1, 2)", "3 local_units for 2 ranks"),
    ),
    "redistribute: units not dividing the rows": (
        lambda mesh: _ragged(mesh).redistribute(mesh, [RaggedShard((0,), (2, 1))]),
        ValueError,
        ("(2, 1)", "sum to 3", "8 prefix rows"),
    ),
    "elementwise op on different layouts (strict mode)": (
        lambda mesh: _strict(lambda: _ragged(mesh) + _ragged(mesh, (3, 1))),
        RaggedOpError,
        ("aten.add", "different layouts", "(3, 1)", "strict mode"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_names_the_offender(name: str) -> None:
    expect_error_on_every_rank(*CASES[name])


def test_non_integer_units_are_rejected() -> None:
    """Regression (found here, fixed in 07833bc): ``RaggedShard((0,), (1.5, 1))`` was accepted
    (signs were validated, not types), so a float flowed into flat ranges and slicing."""
    with pytest.raises(TypeError, match="local_units"):
        RaggedShard((0,), (1.5, 1))  # type: ignore[arg-type]


def _placements_disagree(rank: int, world: int) -> str:
    """Ranks build the same DTensor with different units, each self-consistent locally."""
    mesh = init_device_mesh("cpu", (world,))
    placement = RaggedShard((0,), (1, 3) if rank == 0 else (3, 1))
    r = placement.flat_range(FULL.shape, rank)
    local = FULL.reshape(-1)[r.start : r.stop].clone()
    try:
        dt = from_local(
            local, mesh, [placement], shape=FULL.shape, stride=FULL.stride(), run_check=True
        )
        got = dt.full_tensor()
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return f"no error: {'right' if torch.equal(got, FULL) else 'WRONG'} data"


def test_ranks_disagreeing_on_units_are_detected_by_run_check() -> None:
    """Regression (silent wrong data; found here, fixed in 07833bc): ``DTensor.from_local(...,
    run_check=True)`` checked each rank's local size against its *own* units only. Rank 0 says
    (1, 3), rank 1 says (3, 1): both shares have 8 elements, the padded all-gather of
    ``full_tensor()`` has equal sizes on both ranks, and both returned WRONG data silently. Now
    ``run_check`` compares the ragged layout across the ragged mesh axis."""
    outcomes = run_threaded(_placements_disagree, 2, timeout=60)
    for outcome in outcomes:
        # the shared agreement check's error (a ValueError), naming both ranks' placements
        assert outcome.startswith("RanksDisagreeError") and "local_units" in outcome, outcomes
        assert "ranks [0] have" in outcome and "ranks [1] have" in outcome, outcomes


def test_flat_range_of_a_rank_outside_the_axis_names_it() -> None:
    """Regression (found here, fixed in 979eabb): ``RaggedShard((0,), (1, 3)).flat_range(shape,
    5)`` raised a bare ``IndexError: tuple index out of range``."""
    with pytest.raises(ValueError, match=r"5.*2 ranks|2 ranks.*5"):
        RaggedShard((0,), (1, 3)).flat_range(FULL.shape, 5)
