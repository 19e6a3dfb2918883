"""Ranks that disagree (different models, plans, dtypes, settings, frozen parameters) raise on
every rank within a bounded time: never a hang, never a gloo abort. Ranks that issue different
collectives at run time (one rank runs backward, an extra forward, ``clip_grad_norm_``, a full
state dict, or skips a step) raise a named error within 30 s in the collective debug mode
(``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1``). (Ranks disagreeing on RaggedShard placements:
packages/ragged-dtensor/tests/test_ragged_badinput.py; Muon stepping twice on one rank:
tests/test_reliability_debug_collectives.py.)"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_models import TinyLlama, batches, loss_fn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import Shard, init_device_mesh

from fsdp_engine import MixedPrecisionPolicy, fully_shard
from ragged_dtensor import CollectiveMismatchError
from ragged_dtensor.testing import run_processes, run_threaded

DEADLINE_S = 30.0  # process-group timeout and the bound on every case


def _model_for(rank: int, case: str) -> TinyLlama:
    gen = torch.Generator().manual_seed(0)
    kwargs: dict[str, Any] = {}
    if rank == 1 and case == "hidden_size":
        kwargs = {"dim": 48}
    if rank == 1 and case == "extra_layer":
        kwargs = {"layers": 3}
    if rank == 1 and case == "vocab":
        kwargs = {"vocab": 98}
    model = TinyLlama(**kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    if rank == 1 and case == "dtype":
        model = model.to(torch.bfloat16)
    if rank == 1 and case == "requires_grad":
        model.layers[0].attn_norm.weight.requires_grad_(False)  # frozen on rank 1 only
    if case == "frozen_value":
        model.embed.weight.requires_grad_(False)  # frozen everywhere, another value on rank 1
        if rank == 1:
            with torch.no_grad():
                model.embed.weight[3, 5] += 1.0
    return model


def _shard_disagreeing(rank: int, world: int, case: str) -> str:
    """Every rank shards a TinyLlama per layer and at the root; rank 1 differs by ``case``.
    Returns the error this rank raised (as text), so every rank's outcome is reported."""
    mesh = init_device_mesh("cpu", (world,))
    model = _model_for(rank, case)

    def policy(name: str, param: torch.Tensor) -> int:
        if case == "block_policy" and rank == 1 and param.dim() == 2:
            return int(param.shape[-1])  # whole rows on rank 1 only
        return 1

    try:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, block_policy=policy)
        fully_shard(model, mesh=mesh, block_policy=policy)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


CASES = {
    "hidden_size": "shapes",
    "extra_layer": "",
    "vocab": "shapes",
    "block_policy": "",
    "dtype": "dtype",
    # found by the adversarial runs of issue 14: accepted silently (the frozen rank's zeros were
    # averaged into the others' gradient; the differing frozen value stayed in its shard)
    "requires_grad": "requires_grad of 'attn_norm.weight': ranks [0] have 'True', ranks [1] have "
    "'False'",
    "frozen_value": "value of frozen parameter 'embed.weight'",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_ranks_that_build_different_models_all_raise(case: str) -> None:
    start = time.monotonic()
    outcomes = run_threaded(_shard_disagreeing, 2, case, timeout=DEADLINE_S)
    assert time.monotonic() - start < DEADLINE_S
    for rank, outcome in enumerate(outcomes):
        assert outcome.startswith("LayoutMismatchError"), (rank, outcome)
        assert "ranks [0]" in outcome and "ranks [1]" in outcome, outcome
        assert CASES[case] in outcome, outcome


@pytest.mark.multiprocess
def test_extra_layer_on_one_process_raises_everywhere_in_bounded_time() -> None:
    """Real gloo processes (a mismatch reaching a sized collective would abort them): rank 1
    has one more decoder layer, so its third ``fully_shard`` meets rank 0's root call."""
    start = time.monotonic()
    outcomes = run_processes(_shard_disagreeing, 2, "extra_layer", timeout=DEADLINE_S)
    assert time.monotonic() - start < DEADLINE_S
    for outcome in outcomes:
        assert outcome.startswith("LayoutMismatchError"), outcome


def _train_disagreeing_config(rank: int, world: int, case: str) -> str:
    """Same model everywhere; rank 1 passes another ``fully_shard`` setting."""
    mesh = init_device_mesh("cpu", (world,))
    model = _model_for(rank, "same")
    kwargs: dict[str, Any] = {}
    if rank == 1 and case == "mp_policy":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    if rank == 1 and case == "reshard_after_forward":
        kwargs["reshard_after_forward"] = False
    if rank == 1 and case == "shard_placement_fn":  # one rank asks for FSDP2's layout
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.dim() > 1 else None
    try:
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, **kwargs)
        fully_shard(model, mesh=mesh, **kwargs)
        for tokens in batches(2, 1, batch=4):
            loss_fn(model, tokens.chunk(world)[rank]).backward()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("mp_policy", "bfloat16"),
        ("reshard_after_forward", "reshard"),
        ("shard_placement_fn", "shard_placement_fn"),
    ],
)
def test_ranks_passing_different_fully_shard_settings_all_raise(case: str, named: str) -> None:
    """Found here. The DBuffer record compares layout, dtype and shapes, not the settings that
    decide the collectives: with ``mp_policy`` differing, rank 1 all-gathers bf16 while rank 0
    gathers fp32 (on real gloo processes: SIGABRT); with ``reshard_after_forward`` differing,
    rank 0 issues an extra all-gather in backward that rank 1 never joins (both ranks hang
    until the process-group timeout). Fix (group.py/api.py): add the all-gather dtype
    (``mp_policy.param_dtype``), ``reduce_dtype`` and ``reshard_after_forward`` to the record
    each ``fully_shard`` call compares across ranks (dbuffer could accept extra record entries,
    or export ``check_agreement``), so every rank raises LayoutMismatchError naming them."""
    start = time.monotonic()
    outcomes = run_threaded(_train_disagreeing_config, 2, case, timeout=20)
    assert time.monotonic() - start < DEADLINE_S
    for outcome in outcomes:
        assert outcome.startswith("LayoutMismatchError") and named in outcome, outcomes


def _checkpoint_paths_disagree(rank: int, world: int, root: str, op: str) -> str:
    from pathlib import Path

    from fsdp_engine import load_checkpoint, save_checkpoint

    path = Path(root) / f"step_{rank}"  # each rank names another directory
    try:
        if op == "save":
            save_checkpoint({"x": torch.zeros(2)}, path)
        else:
            load_checkpoint({"x": torch.zeros(2)}, path)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.parametrize("op", ["save", "load"])
def test_ranks_naming_different_checkpoints_all_raise(tmp_path: Any, op: str) -> None:
    """Saving: rank 0 would commit a checkpoint without rank 1's files. Loading: a rank
    raising alone would leave the others in DCP's collectives until the timeout."""
    start = time.monotonic()
    outcomes = run_threaded(_checkpoint_paths_disagree, 2, str(tmp_path), op, timeout=DEADLINE_S)
    assert time.monotonic() - start < DEADLINE_S
    for outcome in outcomes:
        assert outcome.startswith("CheckpointError"), outcomes
        assert "different paths" in outcome and "step_0" in outcome and "step_1" in outcome
    assert not any(tmp_path.iterdir())  # nothing written, nothing committed


# -- run-time disagreements, caught by the collective debug mode -----------------------------------

# Each hung until gloo's timeout (30 min by default; still stuck at 120 s in the adversarial runs
# of issue 14) or aborted the process ("Is there a distributed collective mismatch").
HANG_CASES = {
    "backward on one rank only": "",
    "a no_grad forward on one rank": "",
    "an eval forward on rank 0 only": "",
    "clip_grad_norm_ on one rank only": "all_reduce",
    "one rank skipping a step": "barrier",
    "a full state dict on rank 0 only": "",
}


def _diverge(rank: int, world: int, case: str) -> None:
    """Two training steps of a TinyLlama; in the second, the ranks do different things."""
    mesh = init_device_mesh("cpu", (world,))
    model = _model_for(rank, "same")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step, tokens in enumerate(batches(2, 1, batch=4)):
        odd = step == 1
        mine = tokens.chunk(world)[rank]
        if case == "one rank skipping a step" and odd and rank == 1:
            continue
        loss = loss_fn(model, mine)
        if not (case == "backward on one rank only" and odd and rank == 1):
            loss.backward()
        if case == "clip_grad_norm_ on one rank only" and odd and rank == 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if case == "a no_grad forward on one rank" and odd and rank == 1:
            with torch.no_grad():
                loss_fn(model, mine)
        if case == "an eval forward on rank 0 only" and odd and rank == 0:
            model.eval()
            loss_fn(model, mine)  # a validation loss, grad enabled, no backward
            model.train()
        if case == "a full state dict on rank 0 only" and odd and rank == 0:
            get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    dist.barrier()


def _hang_cases(rank: int, world: int, cases: list[str]) -> dict[str, tuple[str, float]]:
    """Every case in these two processes, each on a fresh process group (the same store)."""
    store = dist.distributed_c10d._get_default_store()
    outcomes = {}
    for index, case in enumerate(cases):
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"case-{index}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        start = time.monotonic()
        try:
            _diverge(rank, world, case)
            outcome = "no error"
        except CollectiveMismatchError as exc:
            outcome = f"CollectiveMismatchError: {exc}"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        outcomes[case] = (outcome, time.monotonic() - start)
    return outcomes


@pytest.mark.multiprocess
def test_runtime_disagreements_raise_a_named_error_in_debug_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real gloo processes with ``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1`` (default timeout): every
    rank raises CollectiveMismatchError naming the process group, each side's operation and
    ranks, within 30 s of the case's start, and no mismatched collective ever runs."""
    monkeypatch.setenv("RAGGED_DTENSOR_DEBUG_COLLECTIVES", "1")  # spawned ranks inherit it
    monkeypatch.delenv("RAGGED_DTENSOR_DEBUG_TIMEOUT", raising=False)
    results = run_processes(_hang_cases, 2, list(HANG_CASES), timeout=300)
    for case, named in HANG_CASES.items():
        for rank, outcomes in enumerate(results):
            outcome, seconds = outcomes[case]
            assert outcome.startswith("CollectiveMismatchError: collective "), (case, rank, outcome)
            assert "process group '" in outcome and "(global ranks [0, 1], gloo)" in outcome
            assert "ranks [0]" in outcome and ("ranks [1]" in outcome or "rank 1" in outcome)
            assert named in outcome, (case, outcome)
            assert seconds < DEADLINE_S, (case, rank, seconds)
    assert os.environ["RAGGED_DTENSOR_DEBUG_COLLECTIVES"] == "1"
