"""transformers' ``Trainer`` with ``fsdp=True, fsdp_config={"version": 2}`` switched to
fsdp_engine by ``fsdp_engine.as_torch_fsdp()``: its accelerator's ``prepare`` shards the model
with ``torch.distributed.fsdp.fully_shard`` and the Trainer registers ``generate`` with
``torch.distributed.fsdp.register_fsdp_forward_method``; both are ours. A tiny random-init
LLaMA with tied embeddings, 2 gloo processes, gradient accumulation 2.

Without gradient clipping (``max_grad_norm=0``) every loss of every rank is bitwise FSDP2's
(kind (a) of [Note: comparisons of the trainer tests] in ``trainer_workers.py``). With the
Trainer's default clipping (``max_grad_norm=1.0``) the gradient norm is a sum of squares taken
over our shards, in another order than FSDP2's: kind (b), ``steps * sqrt(P) * eps32`` relative.

Resuming: the Trainer's own checkpoints (its default format under FSDP2, ``FULL_STATE_DICT``:
rank 0 writes full tensors, the resume broadcasts them from rank 0 with torch's
``set_*_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``) every half of the
run; a new Trainer resumed from the middle one repeats the second half's losses bitwise, on
FSDP2 and on ours.
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
    "no-clipping": {"accumulation": 2, "max_grad_norm": 0.0, "steps": STEPS},
    "clipping": {"accumulation": 2, "max_grad_norm": 1.0, "steps": STEPS},
    "resume": {"accumulation": 2, "max_grad_norm": 0.0, "steps": STEPS, "resume": True},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[dict[str, Any]]]]:
    out_dir: Path = tmp_path_factory.mktemp("hf_trainer")
    names = [(n, e) for n in CASES for e in ("fsdp2", "ours")]
    cases = [{"engine": e, **CASES[n]} for n, e in names]
    per_rank = run_processes(tw.run_transformers, 2, str(out_dir), cases, timeout=900, env=tw.ENV)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for index, (name, engine) in enumerate(names):
        out.setdefault(name, {})[engine] = [per_rank[r][index] for r in range(2)]
    return out


def _check_engines(run: dict[str, list[dict[str, Any]]]) -> None:
    assert [r["engine"] for r in run["fsdp2"]] == ["fsdp2", "fsdp2"]
    assert [r["engine"] for r in run["ours"]] == ["ours", "ours"]
    for result in run["ours"]:
        assert len(result["losses"]) == STEPS * 2  # compute_loss per micro-batch


def test_hf_trainer_without_clipping_trains_bitwise_like_fsdp2(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    run = runs["no-clipping"]
    _check_engines(run)
    for rank in range(2):
        assert run["ours"][rank]["losses"] == run["fsdp2"][rank]["losses"], rank


def test_hf_trainer_with_clipping_matches_fsdp2_within_the_norm_tolerance(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    run = runs["clipping"]
    _check_engines(run)
    tol = tw.clip_tolerance(run["ours"][0]["parameters"], STEPS)
    for rank in range(2):
        got, want = run["ours"][rank]["losses"], run["fsdp2"][rank]["losses"]
        assert got[:2] == want[:2]  # the first step's micro-batches: before any clipping
        worst = max(abs(g - w) / abs(w) for g, w in zip(got, want, strict=True))
        assert worst <= tol, f"rank {rank}: relative difference {worst:.2e} > {tol:.2e}"
    # the clipping took effect: the clipped run's losses differ from the unclipped ones
    assert run["fsdp2"][0]["losses"] != runs["no-clipping"]["fsdp2"][0]["losses"]


def test_hf_trainer_resumes_from_its_default_checkpoint_like_fsdp2(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    run = runs["resume"]
    _check_engines(run)
    for rank in range(2):
        ours, fsdp2 = run["ours"][rank], run["fsdp2"][rank]
        assert ours["resumed_engine"] == "ours" and fsdp2["resumed_engine"] == "fsdp2"
        assert ours["losses"] == fsdp2["losses"], rank
        half = len(ours["losses"]) // 2
        assert fsdp2["resumed"] == fsdp2["losses"][half:], rank  # the control resumes exactly
        assert ours["resumed"] == ours["losses"][half:], rank
