"""The public API: errors, zero-size tensors, fingerprints, units and slices on known layouts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from planner_testing import check_plan_independently

import shard_planner as sp
from shard_planner import Slice, TensorSpec


def test_public_names() -> None:
    for name in sp.__all__:
        assert hasattr(sp, name), name
    assert isinstance(sp.__version__, str)


CORE = {
    "TensorSpec",
    "Plan",
    "Slice",
    "plan",
    "METHODS",
    "lower_bound",
    "exact_plan",
    "MAX_EXACT_TENSORS",
    "naive_plan",
    "megatron_plan",
    "fsdp2_layout",
    "Fsdp2Layout",
    "__version__",
}


def test_top_level_is_the_packing_core_and_projection_is_a_subpackage() -> None:
    """The split of 0.2.0: the top level is the packing core, the rest lives in
    ``shard_planner.projection`` (no deprecated top-level aliases)."""
    import shard_planner.projection as proj

    assert set(sp.__all__) == CORE
    for name in proj.__all__:
        assert hasattr(proj, name), name
        assert not hasattr(sp, name), f"shard_planner.{name} should only be in the subpackage"
    assert {"project", "advise", "catalogue_model", "MODELS", "GPUS", "Setup"} <= set(proj.__all__)


def test_importing_the_core_does_not_import_the_projection() -> None:
    code = (
        "import sys, shard_planner; "
        "loaded = sorted(m for m in sys.modules if m.startswith('shard_planner.projection')); "
        "assert not loaded, loaded"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: sp.plan([TensorSpec(10, 4, "w")], 2), "block 4 must divide numel 10"),
        (lambda: sp.plan([TensorSpec(8, 4)], 2, 0), "align must be an int >= 1"),
        (lambda: sp.plan([TensorSpec(8, 4)], 2, -16), "align must be an int >= 1"),
        (lambda: sp.plan([], 2), "specs is empty"),
        (lambda: sp.plan([TensorSpec(8, 4)], 0), "world_size must be an int >= 1"),
        (lambda: sp.plan([TensorSpec(8, 4)], 2, method="ilp"), "method must be one of"),
        (lambda: TensorSpec(-1, 1, "neg"), "'neg': numel must be >= 0"),
        (lambda: TensorSpec(4, 0, "zero"), "block must be >= 1"),
        (lambda: sp.exact_plan([TensorSpec(4, 1)] * 9, 2), "at most 8"),
        (lambda: sp.lower_bound([TensorSpec(4, 1)], 0), "world_size"),
    ],
)
def test_bad_input_raises_value_error_naming_it(make, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        make()


def test_error_names_the_tensor() -> None:
    with pytest.raises(ValueError, match=r"'layers\.0\.w'"):
        TensorSpec(12, 5, "layers.0.w")


def test_zero_size_tensors() -> None:
    specs = [TensorSpec(0, 4, "empty"), TensorSpec(12, 4, "a"), TensorSpec(0, 1, "b")]
    for method in sp.METHODS:
        p = sp.plan(specs, 3, 2, method=method)
        p.validate()
        check_plan_independently(p, specs)
        assert all(sl.tensor_index == 1 for r in range(3) for sl in p.rank_slices(r))
    only_empty = sp.plan([TensorSpec(0, 1)], 4, 8)
    assert only_empty.shard_size == 8 and only_empty.padding == 32
    assert only_empty.padding_ratio == 0.0
    assert sum(only_empty.local_units(0)) == 1


def test_known_layout_units_and_slices() -> None:
    # 4 ranks, blocks of 4 elements: 32 + 16 + 8 = 56 elements -> S = 14 is not a multiple of
    # 4 but the search finds the smallest workable size and every rank gets whole blocks.
    specs = [TensorSpec(32, 4, "w"), TensorSpec(16, 4, "v"), TensorSpec(8, 1, "b")]
    p = sp.plan(specs, 4)
    check_plan_independently(p, specs)
    assert p.shard_size == sp.exact_plan(specs, 4).shard_size
    assert p.shard_size >= 14
    for i in range(3):
        units = p.local_units(i)
        assert sum(units) * specs[i].block == specs[i].numel


def test_rank_slices_exact_values() -> None:
    specs = [TensorSpec(6, 2, "a"), TensorSpec(6, 3, "b")]
    p = sp.plan(specs, 2, 6)
    assert p.shard_size == 6
    assert p.rank_slices(0) == (Slice(0, 0, 6, 0, 6),) or p.rank_slices(0) == (
        Slice(1, 0, 6, 0, 6),
    )
    assert p.local_units(0) in ((3, 0), (0, 3))
    with pytest.raises(ValueError, match="rank 2 out of range"):
        p.rank_slices(2)
    with pytest.raises(ValueError, match="tensor index 5"):
        p.local_units(5)


def test_validate_catches_a_cut_block_and_overlap() -> None:
    good = sp.plan([TensorSpec(8, 4, "w"), TensorSpec(8, 4, "v")], 2)
    bad = sp.Plan(
        world_size=2,
        shard_size=8,
        align=1,
        numels=(8, 8),
        blocks=(4, 4),
        names=("w", "v"),
        offsets=(2, 10),
        order=(0, 1),
    )
    with pytest.raises(ValueError, match=r"'w'\): shard boundary 8 cuts a block"):
        bad.validate()
    overlap = sp.Plan(
        world_size=2,
        shard_size=8,
        align=1,
        numels=(8, 8),
        blocks=(4, 4),
        names=("w", "v"),
        offsets=(0, 4),
        order=(0, 1),
    )
    with pytest.raises(ValueError, match="overlaps"):
        overlap.validate()
    outside = sp.Plan(
        world_size=2,
        shard_size=8,
        align=1,
        numels=(8, 8),
        blocks=(4, 4),
        names=("w", "v"),
        offsets=(0, 12),
        order=(0, 1),
    )
    with pytest.raises(ValueError, match="outside the buffer"):
        outside.validate()
    good.validate()


def test_plan_is_frozen_and_hashable() -> None:
    p = sp.plan([TensorSpec(8, 4)], 2)
    with pytest.raises(AttributeError):
        p.shard_size = 3  # type: ignore[misc]
    assert {p: 1}[sp.plan([TensorSpec(8, 4)], 2)] == 1


_FINGERPRINT_SCRIPT = """
import shard_planner as sp
specs = [sp.TensorSpec(4096 * 7, 4096, "mlp.w"), sp.TensorSpec(300, 3, "ö-bias"),
         sp.TensorSpec(0, 1, "empty"), sp.TensorSpec(1000, 1)]
print(sp.plan(specs, 13, 8).fingerprint)
"""


def test_fingerprint_is_stable_across_processes_and_hash_seeds() -> None:
    prints = set()
    for seed in ("0", "1", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", _FINGERPRINT_SCRIPT],
            check=True,
            capture_output=True,
            text=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        prints.add(out.stdout.strip())
    assert len(prints) == 1
    (value,) = prints
    assert len(value) == 64 and int(value, 16) >= 0


def test_fingerprint_changes_with_any_field() -> None:
    specs = [TensorSpec(64, 4, "a"), TensorSpec(32, 4, "b")]
    base = sp.plan(specs, 4)
    assert sp.plan(specs, 4).fingerprint == base.fingerprint
    assert sp.plan(specs, 8).fingerprint != base.fingerprint
    renamed = [TensorSpec(64, 4, "a"), TensorSpec(32, 4, "c")]
    assert sp.plan(renamed, 4).fingerprint != base.fingerprint
    assert sp.plan(specs, 4, 4).fingerprint != base.fingerprint or base.align == 4


def test_baselines_are_valid_and_ordered() -> None:
    specs = [TensorSpec(24 * 10, 24, "x"), TensorSpec(16 * 7, 16, "y"), TensorSpec(5, 1, "z")]
    for world in (1, 2, 3, 8):
        naive = sp.naive_plan(specs, world, 2)
        mega = sp.megatron_plan(specs, world, 2)
        for p in (naive, mega):
            p.validate()
            check_plan_independently(p, specs)
        assert naive.shard_size <= mega.shard_size
        assert sp.plan(specs, world, 2).shard_size <= naive.shard_size


def test_fsdp2_layout_figures() -> None:
    # 128 experts over 256 ranks: every rank stores one expert row-block, half of them padding.
    layout = sp.fsdp2_layout([(128, 4, 6)], [6], 256)
    assert layout.shard_numel == 24 and layout.buffer_numel == 2 * 128 * 24
    assert layout.padding_ratio == pytest.approx(1.0)
    odd = sp.fsdp2_layout([(1001, 512)], [512 * 32], 2)
    assert odd.shard_numel == 501 * 512 and odd.cuts_blocks == (0,)
    with pytest.raises(ValueError, match="world_size"):
        sp.fsdp2_layout([(4,)], [1], 0)
