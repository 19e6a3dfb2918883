"""fully_shard trains exactly like one process and like torch's FSDP2 on the same script.

Numerics (see the Note in ``engine_training``): the ``same arithmetic`` tests compare bitwise
against ``reference_per_rank`` or torch's FSDP2, one intra-op thread on both sides; the
``different arithmetic`` tests compare float64 runs against the whole-batch reference within
``FP64_TOLERANCE``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_training import (
    FP64_TOLERANCE,
    assert_bitwise_equal,
    max_relative_difference,
    reference,
    reference_per_rank,
    train_sharded,
)

from ragged_dtensor.testing import run_processes, run_threaded

pytestmark = pytest.mark.numerics

STEPS = 10


def _per_rank_reference(world: int, steps: int = STEPS, **kwargs: Any) -> list[dict[str, Any]]:
    torch.set_num_threads(1)  # the ranks run with one thread too
    losses, params = reference_per_rank(steps, world, **kwargs)
    return [{"params": params, "local_losses": losses[rank]} for rank in range(world)]


def _check_bitwise(results: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    for rank, (got, expected) in enumerate(zip(results, want, strict=True)):
        assert_bitwise_equal(got, expected, f"{what}, rank {rank}")


def _check_fp64(results: list[dict[str, Any]], ref_losses: list[float], ref: Any) -> None:
    for result in results:
        for got, want in zip(result["losses"], ref_losses, strict=True):
            assert abs(got - want) <= FP64_TOLERANCE * max(1.0, abs(want))
        assert max_relative_difference(result["params"], ref) <= FP64_TOLERANCE


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
@pytest.mark.parametrize("world", [2, 4])
def test_matches_single_process_threaded(world: int, optimizer: str) -> None:
    """Same arithmetic: bitwise equal to the per-rank single-process computation."""
    want = _per_rank_reference(world, optimizer=optimizer)
    results = run_threaded(
        lambda r, w: train_sharded(r, w, steps=STEPS, optimizer=optimizer), world, timeout=300
    )
    _check_bitwise(results, want, f"ws {world} {optimizer}")


@pytest.mark.parametrize("world", [2, 4])
def test_matches_whole_batch_single_process_in_float64(world: int) -> None:
    """Different arithmetic: the whole global batch at once (float64, ``FP64_TOLERANCE``)."""
    ref_losses, ref_params = reference(STEPS, world, dtype=torch.float64)
    results = run_threaded(
        lambda r, w: train_sharded(r, w, steps=STEPS, dtype=torch.float64), world, timeout=300
    )
    _check_fp64(results, ref_losses, ref_params)


@pytest.mark.parametrize("reshard", [False, 1, 2, 4], ids=["False", "int1", "int2", "int4"])
def test_reshard_after_forward_variants(reshard: bool | int) -> None:
    """Same arithmetic, bitwise. At 4 ranks, 2 keeps half of the unsharded buffer per rank and
    re-gathers within pairs."""
    want = _per_rank_reference(4)
    results = run_threaded(
        lambda r, w: train_sharded(r, w, steps=STEPS, reshard_after_forward=reshard), 4, timeout=300
    )
    _check_bitwise(results, want, f"reshard_after_forward={reshard}")


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
    kept = state.group.post_forward.chunk.numel()
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


def test_gradient_accumulation_without_sync() -> None:
    """Same arithmetic, bitwise: two micro-batches accumulated unsharded, one reduction."""
    want = _per_rank_reference(2, steps=4, micro=2)
    results = run_threaded(lambda r, w: train_sharded(r, w, steps=4, micro=2), 2, timeout=300)
    _check_bitwise(results, want, "accumulation")


def test_hsdp_2x2_matches_single_process() -> None:
    """Same arithmetic, bitwise: reduce-scatter within each replica, all-reduce across them."""
    want = _per_rank_reference(4, mesh_shape=(2, 2))
    results = run_threaded(
        lambda r, w: train_sharded(r, w, steps=STEPS, mesh_shape=(2, 2)), 4, timeout=300
    )
    _check_bitwise(results, want, "HSDP 2x2")


@pytest.mark.parametrize("case", ["adamw", "sgd", "no-reshard", "accumulate", "hsdp"])
def test_matches_torch_fsdp2_on_the_same_script(case: str) -> None:
    """Same arithmetic as torch's FSDP2 (same per-rank kernels; sums of power-of-two rank
    counts scaled by powers of two): bitwise."""
    kwargs: dict[str, object] = {"steps": 6}
    world = 2
    if case == "sgd":
        kwargs["optimizer"] = "sgd"
    elif case == "no-reshard":
        kwargs["reshard_after_forward"] = False
    elif case == "accumulate":
        kwargs["micro"] = 2
    elif case == "hsdp":
        kwargs["mesh_shape"] = (2, 2)
        world = 4
    ours = run_threaded(
        lambda r, w: train_sharded(r, w, engine="ours", **kwargs), world, timeout=300
    )
    theirs = run_threaded(
        lambda r, w: train_sharded(r, w, engine="fsdp2", **kwargs), world, timeout=300
    )
    _check_bitwise(ours, theirs, f"vs FSDP2 ({case})")


def test_bf16_mixed_precision_matches_torch_fsdp2() -> None:
    """Same arithmetic as torch's FSDP2 with bf16 compute and fp32 reduction: both cast the fp32
    shards to bf16 the same way, run the same bf16 kernels, and reduce in fp32: bitwise."""
    kwargs = {"steps": 6, "param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    ours = run_threaded(lambda r, w: train_sharded(r, w, engine="ours", **kwargs), 2, timeout=300)
    theirs = run_threaded(
        lambda r, w: train_sharded(r, w, engine="fsdp2", **kwargs), 2, timeout=300
    )
    _check_bitwise(ours, theirs, "bf16 vs FSDP2")


def _gloo_parity(rank: int, world: int) -> dict[str, object]:
    return train_sharded(rank, world, steps=STEPS)


def _gloo_parity_fp64(rank: int, world: int) -> dict[str, object]:
    return train_sharded(rank, world, steps=STEPS, dtype=torch.float64)


@pytest.mark.multiprocess
def test_matches_single_process_on_gloo_bitwise() -> None:
    """Same arithmetic across real processes (2 ranks: gloo's sum of two is order-free):
    bitwise equal to the per-rank single-process computation."""
    want = _per_rank_reference(2)
    _check_bitwise(run_processes(_gloo_parity, 2, timeout=300, threads=1), want, "gloo ws 2")


@pytest.mark.slow  # CI budget; the threaded float64 test at 4 ranks stays in CI
@pytest.mark.multiprocess
def test_matches_whole_batch_on_gloo_4_ranks_in_float64() -> None:
    """Different arithmetic: gloo sums 4 ranks in its own (ring) order, and the reference takes
    the whole batch at once; float64 within ``FP64_TOLERANCE``."""
    ref_losses, ref_params = reference(STEPS, 4, dtype=torch.float64)
    _check_fp64(run_processes(_gloo_parity_fp64, 4, timeout=300, threads=1), ref_losses, ref_params)
