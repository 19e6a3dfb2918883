"""accelerate's FSDP2 plugin (``FullyShardedDataParallelPlugin(fsdp_version=2)``) switched to
fsdp_engine by ``fsdp_engine.as_torch_fsdp()``: ``accelerator.prepare`` calls
``torch.distributed.fsdp.fully_shard`` (its embedding, its tail ``[norm, embedding, head]``
with the tied weight, every decoder layer, the root) and gets ours; 2 gloo processes.

Every loss of every rank is bitwise FSDP2's (kind (a) of [Note: comparisons of the trainer
tests] in ``trainer_workers.py``): plain training of a tied-embedding LLaMA, gradient
accumulation (``accelerator.accumulate``: ``set_requires_gradient_sync(False)`` on the
micro-batches before the last), bf16 mixed precision (accelerate's autocast and the plugin's
``MixedPrecisionPolicy(param_dtype=bf16)``), the plugin's activation checkpointing, its
``reshard_after_forward=False``, and ``accelerator.save_state`` / ``load_state`` in the middle
of training (resumed losses repeat bitwise), with the plugin's sharded checkpoints and with
``state_dict_type="FULL_STATE_DICT"`` (rank 0 writes full tensors; the load broadcasts them
from rank 0: torch's ``set_*_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trainer_workers as tw

from ragged_dtensor.testing import run_processes

pytestmark = pytest.mark.multiprocess

STEPS = 4
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "accumulation": {"accumulation": 2},
    "bf16": {"mixed_precision": "bf16"},
    "activation_checkpointing": {"activation_checkpointing": True},
    "no-reshard": {"reshard_after_forward": False},
    "save-load-state": {"save_load": True},
    "save-load-full-state": {"save_load": True, "state_dict_type": "FULL_STATE_DICT"},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Every case on FSDP2, then on ours, in one launch of 2 processes."""
    out: Path = tmp_path_factory.mktemp("accelerate")
    names = [(n, e) for n in CASES for e in ("fsdp2", "ours")]
    cases = [{"name": n, "engine": e, "steps": STEPS, **CASES[n]} for n, e in names]
    per_rank = run_processes(tw.run_accelerate, 2, str(out), cases, timeout=900, env=tw.ENV)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for index, (name, engine) in enumerate(names):
        runs.setdefault(name, {})[engine] = [per_rank[r][index] for r in range(2)]
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_accelerate_fsdp2_plugin_trains_bitwise_like_fsdp2(
    runs: dict[str, dict[str, list[dict[str, Any]]]], case: str
) -> None:
    fsdp2, ours = runs[case]["fsdp2"], runs[case]["ours"]
    assert [r["engine"] for r in fsdp2] == ["fsdp2", "fsdp2"]
    assert [r["engine"] for r in ours] == ["ours", "ours"]  # the switch reached accelerate
    micro_batches = STEPS * CASES[case].get("accumulation", 1)
    for rank, (theirs, mine) in enumerate(zip(fsdp2, ours, strict=True)):
        assert len(mine["losses"]) == micro_batches
        assert mine["losses"] == theirs["losses"], (case, rank)
        assert mine["resumed"] == theirs["resumed"], (case, rank)
        assert mine["tied"] and theirs["tied"]  # the head is still the embedding's parameter
    assert ours[0]["losses"] != ours[1]["losses"]  # the ranks saw different rows


def test_accelerate_save_and_load_state_resume_exactly(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    """``accelerator.save_state`` / ``load_state`` (DCP: the sharded model and optimizer) after
    half the steps: the second half, trained again after loading, repeats its losses bitwise, on
    FSDP2 and on ours (whose losses equal FSDP2's: the test above)."""
    for engine in ("fsdp2", "ours"):
        for case in ("save-load-state", "save-load-full-state"):
            for result in runs[case][engine]:
                assert result["resumed"] == result["losses"][STEPS // 2 :], (case, engine)
    # without save_state nothing is resumed
    assert runs["plain"]["ours"][0]["resumed"] is None
