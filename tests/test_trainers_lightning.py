"""Lightning's ``ModelParallelStrategy`` switched to fsdp_engine by ``fsdp_engine.as_torch_fsdp()``:
the user's module shards itself with ``torch.distributed.fsdp.fully_shard`` (in
``LightningModule.configure_model``, or Fabric's ``parallelize_fn``) and gets ours; 2 gloo
processes started the way torchrun starts them.

Every loss of every rank is bitwise FSDP2's (kind (a) of [Note: comparisons of the trainer
tests] in ``trainer_workers.py``): ``Trainer.fit`` plain, with ``accumulate_grad_batches=2``,
with ``precision="bf16-mixed"``, and saved after half the steps then resumed in a new trainer
(``fit(ckpt_path=...)``, Lightning's distributed checkpoint; the resumed losses are the
uninterrupted run's); Fabric with accumulation under ``fabric.no_backward_sync``, which toggles
``set_requires_gradient_sync`` only on modules that are ``isinstance`` torch's
``FSDPModule`` (imported from ``torch.distributed._composable.fsdp``): no reduce-scatter is
issued in the micro-batches it covers, with either engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trainer_workers as tw

from ragged_dtensor.testing import run_processes

pytestmark = pytest.mark.multiprocess

CASES: dict[str, dict[str, Any]] = {
    "trainer-plain": {"api": "trainer", "accumulation": 1},
    "trainer-accumulation": {"api": "trainer", "accumulation": 2},
    "trainer-bf16-mixed": {"api": "trainer", "accumulation": 1, "precision": "bf16-mixed"},
    "trainer-checkpoint-resume": {"api": "trainer", "accumulation": 1, "save_load": True},
    "fabric-accumulation": {"api": "fabric", "accumulation": 2},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, list[dict[str, Any]]]]:
    out: Path = tmp_path_factory.mktemp("lightning")
    names = [(n, e) for n in CASES for e in ("fsdp2", "ours")]
    cases = [{"name": n, "engine": e, **CASES[n]} for n, e in names]
    per_rank = run_processes(tw.run_lightning, 2, str(out), cases, timeout=900, env=tw.ENV)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for index, (name, engine) in enumerate(names):
        runs.setdefault(name, {})[engine] = [per_rank[r][index] for r in range(2)]
    return runs


@pytest.mark.parametrize("case", list(CASES))
def test_lightning_model_parallel_strategy_trains_bitwise_like_fsdp2(
    runs: dict[str, dict[str, list[dict[str, Any]]]], case: str
) -> None:
    fsdp2, ours = runs[case]["fsdp2"], runs[case]["ours"]
    assert [r["engine"] for r in fsdp2] == ["fsdp2", "fsdp2"]
    assert [r["engine"] for r in ours] == ["ours", "ours"]
    for rank, (theirs, mine) in enumerate(zip(fsdp2, ours, strict=True)):
        assert len(mine["losses"]) == 4 * CASES[case]["accumulation"]
        assert mine["losses"] == theirs["losses"], (case, rank)
        assert mine.get("resumed") == theirs.get("resumed"), (case, rank)
    assert ours[0]["losses"] != ours[1]["losses"]


def test_lightning_bf16_mixed_differs_from_fp32(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    """The bf16 case ran in bf16 (its losses are not fp32's), on both engines alike (above)."""
    bf16, fp32 = runs["trainer-bf16-mixed"]["ours"][0], runs["trainer-plain"]["ours"][0]
    assert bf16["losses"] != fp32["losses"]


def test_lightning_checkpoint_resume_continues_exactly(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    """``trainer.save_checkpoint`` after 2 of 4 steps, ``fit(ckpt_path=...)`` in a new trainer:
    the resumed steps' losses are the uninterrupted run's, bitwise, on both engines."""
    for engine in ("fsdp2", "ours"):
        for result in runs["trainer-checkpoint-resume"][engine]:
            assert result["resumed"] == result["losses"][2:], engine


def test_fabric_no_backward_sync_reaches_our_modules(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    for engine in ("fsdp2", "ours"):
        assert [r["unsynced_reductions"] for r in runs["fabric-accumulation"][engine]] == [0, 0]
