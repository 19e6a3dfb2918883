"""Bad-input catalogue (planner): each bad argument raises the stated error type, and the
message names the offending tensor or argument and what was expected."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import shard_planner as sp
import shard_planner.projection as proj

T = sp.TensorSpec


def _one() -> list[sp.TensorSpec]:
    return [T(numel=4, name="w")]


CASES: dict[str, tuple[Callable[[], object], type[Exception], tuple[str, ...]]] = {
    "block does not divide numel": (
        lambda: T(numel=10, block=3, name="layer.w"),
        ValueError,
        ("'layer.w'", "block 3 must divide numel 10"),
    ),
    "negative numel": (lambda: T(numel=-1, name="w"), ValueError, ("'w'", "numel must be >= 0")),
    "zero block": (
        lambda: T(numel=4, block=0, name="w"),
        ValueError,
        ("'w'", "block must be >= 1"),
    ),
    "float numel": (lambda: T(numel=4.0, name="w"), TypeError, ("TensorSpec.numel", "float")),  # type: ignore[arg-type]
    "world size 0": (lambda: sp.plan(_one(), 0), ValueError, ("world_size", "got 0")),
    "world size bool": (lambda: sp.plan(_one(), True), ValueError, ("world_size", "True")),
    "align 0": (lambda: sp.plan(_one(), 2, 0), ValueError, ("align", "got 0")),
    "empty group": (lambda: sp.plan([], 2), ValueError, ("specs is empty",)),
    "not a TensorSpec": (
        lambda: sp.plan([T(4, name="a"), (4, 1)], 2),  # type: ignore[list-item]
        ValueError,
        ("specs[1]", "TensorSpec", "tuple"),
    ),
    "unknown method": (
        lambda: sp.plan(_one(), 2, method="bogus"),  # type: ignore[arg-type]
        ValueError,
        ("method", "'bogus'", "'auto'"),
    ),
    "exact solver on too many tensors": (
        lambda: sp.plan([T(4, name=f"w{i}") for i in range(9)], 2, method="exact"),
        ValueError,
        ("at most 8", "got 9"),
    ),
    "local_units of a missing tensor": (
        lambda: sp.plan(_one(), 2).local_units(3),
        ValueError,
        ("tensor index 3", "1 tensors"),
    ),
    "rank_slices of a missing rank": (
        lambda: sp.plan(_one(), 2).rank_slices(2),
        ValueError,
        ("rank 2", "world_size 2"),
    ),
    "baseline with world size 0": (
        lambda: sp.megatron_plan(_one(), 0),
        ValueError,
        ("world_size", "got 0"),
    ),
    "projection: MFU above 1": (
        lambda: proj.Setup(mfu=1.5),
        ValueError,
        ("Setup.mfu", "(0, 1]", "1.5"),
    ),
    "projection: unknown optimizer": (
        lambda: proj.Setup(optimizer="lion"),
        ValueError,
        ("Setup.optimizer", "adamw"),
    ),
    "projection: shard group not dividing the world": (
        lambda: proj.project(
            proj.catalogue_model("llama3-8b"), 64, proj.GPUS["H100"], shard_ranks=48
        ),
        ValueError,
        ("shard_ranks 48", "divisor of the world size 64"),
    ),
    "advisor: shard choice not dividing the world": (
        lambda: proj.advise(
            proj.catalogue_model("llama3-8b"), 64, proj.GPUS["H100"], shard_choices=[5]
        ),
        ValueError,
        ("shard choice 5", "world size 64"),
    ),
    "catalogue: unknown hyper-parameter": (
        lambda: proj.catalogue_model("llama3-8b", {"hiddn": 128}),
        ValueError,
        ("'llama3-8b'", "'hiddn'", "hidden"),
    ),
    "catalogue: non-positive width": (
        lambda: proj.catalogue_model("llama3-8b", {"hidden": 0}),
        ValueError,
        ("hidden=0", "int >= 1"),
    ),
    "projection: layers per group 0": (
        lambda: proj.project(
            proj.catalogue_model("llama3-8b"), 8, proj.GPUS["H100"], layers_per_group=0
        ),
        ValueError,
        ("layers_per_group", "got 0"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_names_the_offender(name: str) -> None:
    fn, kind, fragments = CASES[name]
    with pytest.raises(kind) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), (name, str(info.value))


def test_numpy_integer_world_size_is_accepted() -> None:
    """Regression (found here, fixed in cbfaf07): ``plan(specs, np.int64(4))`` raised "world_size
    must be an int >= 1, got np.int64(4)" (a message contradicting itself)."""
    assert sp.plan(_one(), np.int64(2)).world_size == 2  # type: ignore[arg-type]
