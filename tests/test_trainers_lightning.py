"""Lightning's ``ModelParallelStrategy`` switched to fsdp_engine by ``fsdp_engine.as_torch_fsdp()``:
the user's module shards itself with ``torch.distributed.fsdp.fully_shard`` (in
``LightningModule.configure_model``, or Fabric's ``parallelize_fn``) and gets ours; 2 gloo
processes started the way torchrun starts them.

Every loss of every rank is bitwise FSDP2's (kind (a) of [Note: comparisons of the trainer
tests] in ``trainer_workers.py``): ``Trainer.fit`` plain and with ``accumulate_grad_batches=2``;
Fabric with accumulation under ``fabric.no_backward_sync``, which toggles
``set_requires_gradient_sync`` only on modules that are ``isinstance`` torch's
``FSDPModule`` (imported from ``torch.distributed._composable.fsdp``): no reduce-scatter is
issued in the micro-batches it covers, with either engine.
"""

from __future__ import annotations

from typing import Any

import pytest
import trainer_workers as tw

from ragged_dtensor.testing import run_processes

pytestmark = pytest.mark.multiprocess

CASES: dict[str, dict[str, Any]] = {
    "trainer-plain": {"api": "trainer", "accumulation": 1},
    "trainer-accumulation": {"api": "trainer", "accumulation": 2},
    "fabric-accumulation": {"api": "fabric", "accumulation": 2},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, dict[str, list[dict[str, Any]]]]:
    names = [(n, e) for n in CASES for e in ("fsdp2", "ours")]
    cases = [{"engine": e, **CASES[n]} for n, e in names]
    per_rank = run_processes(tw.run_lightning, 2, cases, timeout=900, env=tw.ENV)
    out: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for index, (name, engine) in enumerate(names):
        out.setdefault(name, {})[engine] = [per_rank[r][index] for r in range(2)]
    return out


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
    assert ours[0]["losses"] != ours[1]["losses"]


def test_fabric_no_backward_sync_reaches_our_modules(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
) -> None:
    for engine in ("fsdp2", "ours"):
        assert [r["unsynced_reductions"] for r in runs["fabric-accumulation"][engine]] == [0, 0]
