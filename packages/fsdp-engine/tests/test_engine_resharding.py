"""Resharding after forward (``reshard_after_forward`` None / True / False / an int, and
``set_reshard_after_forward``): which parameters stay unsharded, what each step gathers, and
training unchanged, like FSDP2 and one process.

Numeric kind of every value comparison here: *same arithmetic* (see the Note in
``engine_training``): bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    ALL_GATHER,
    ENGINES,
    REDUCE_SCATTER,
    Stack,
    counting,
    data,
    engine,
    make,
    shard_stack,
)
from engine_training import STEPS, check_bitwise, per_rank_reference, train_sharded
from torch.distributed.tensor import DTensor

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def _registered_after_forward(rank: int, world: int, impl: str, raf: Any) -> dict[str, bool]:
    """Which parameters are DTensors (sharded) right after forward."""
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    shard_stack(api, model, reshard_after_forward=raf)
    model(data(rank))
    return {name: isinstance(p, DTensor) for name, p in model.named_parameters()}


@pytest.mark.parametrize("raf", [None, True, False, 2], ids=["None", "True", "False", "int2"])
def test_reshard_after_forward_none_keeps_only_the_root_unsharded(raf: Any) -> None:
    """``None`` (the default): every module reshards after forward except the root, whose
    parameters are needed first in backward; ``True``/``False``/an int apply to the root too."""
    by_engine = {impl: run_threaded(_registered_after_forward, 4, impl, raf)[0] for impl in ENGINES}
    assert by_engine["ours"] == by_engine["fsdp2"], by_engine
    sharded = by_engine["ours"]
    root = [n for n in sharded if not n.startswith("blocks.")]
    blocks = [n for n in sharded if n.startswith("blocks.")]
    assert all(sharded[n] == (raf is not False) for n in blocks), sharded
    assert all(sharded[n] == (raf not in (None, False)) for n in root), sharded


def _step_counts(rank: int, world: int, impl: str, raf: Any, root_raf: bool | None) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(Stack)
    shard_stack(api, model, reshard_after_forward=raf)
    if root_raf is not None:
        model.set_reshard_after_forward(root_raf, recurse=False)  # type: ignore[operator]
    out = []
    for step in range(2):
        with counting() as forward:
            loss = model(data(rank, step)).sum()
        with counting() as backward:
            loss.backward()
        out.append((dict(forward), dict(backward)))
    return out


@pytest.mark.parametrize(
    ("raf", "root_raf"),
    [(None, None), (True, None), (False, None), (2, None), (None, True), (True, False)],
    ids=["None", "True", "False", "int2", "None-root-set-True", "True-root-set-False"],
)
def test_collectives_per_step_match_fsdp2(raf: Any, root_raf: bool | None) -> None:
    """One all-gather per group in forward; in backward one per group that resharded, one
    reduce-scatter per group, nothing else (at 4 ranks, so ``2`` re-gathers in pairs)."""
    ours = run_threaded(_step_counts, 4, "ours", raf, root_raf)
    theirs = run_threaded(_step_counts, 4, "fsdp2", raf, root_raf)
    assert ours == theirs, (ours, theirs)
    forward, backward = ours[0][0]
    assert forward == {ALL_GATHER: 3}, forward
    assert backward[REDUCE_SCATTER] == 3, backward


@pytest.mark.parametrize("reshard", [False, 1, 2, 4], ids=["False", "int1", "int2", "int4"])
def test_reshard_after_forward_variants(reshard: bool | int) -> None:
    """Same arithmetic, bitwise. At 4 ranks, 2 keeps half of the unsharded buffer per rank and
    re-gathers within pairs."""
    want = per_rank_reference(4)
    results = run_threaded(
        lambda r, w: train_sharded(r, w, steps=STEPS, reshard_after_forward=reshard), 4, timeout=300
    )
    check_bitwise(results, want, f"reshard_after_forward={reshard}")


def _subgroup_counts(rank: int, world: int) -> dict[str, int]:
    from engine_models import batches, build, loss_fn
    from torch.distributed.tensor import init_device_mesh

    from fsdp_engine import fully_shard
    from ragged_dtensor.testing import count_collectives

    mesh = init_device_mesh("cpu", (world,))
    model = build()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    fully_shard(model, mesh=mesh)
    tokens = batches(1, world)[0].chunk(world)[rank]
    loss = loss_fn(model, tokens)
    state = model.layers[0].__dict__["_fsdp_engine_state"]
    kept = state.group.post_forward_part.chunk.numel()
    full = state.group.storage.buffer.shard_size * world
    with count_collectives() as counter:
        loss.backward()
    return {
        "kept": kept,
        "full": full,
        "gathers": counter.calls.get("all_gather_single", 0),
        "gather_bytes": counter.bytes.get("all_gather_single", 0),
    }


def test_reshard_after_forward_int_keeps_a_part_and_gathers_in_the_subgroup() -> None:
    for result in run_threaded(_subgroup_counts, 4, timeout=120):
        assert result["kept"] * 2 == result["full"], result
        assert result["gathers"] == 2, result  # one per resharded layer, inside its pair
