"""The agreement check every package shares: one fixed-size all-gather per mesh axis when the
ranks agree, the same error (naming the key and the ranks on each side) on every rank when they
do not."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from ragged_dtensor import RanksDisagreeError, check_ranks_agree, gather_records_if_different
from ragged_dtensor.testing import count_collectives, run_threaded


def _agree(rank: int, world: int, shape: tuple[int, ...], odd: int | None) -> dict[str, object]:
    mesh = init_device_mesh("cpu", shape)
    record = {"layout": "a", "dtype": "float32", "rank-specific?": "no"}
    if rank == odd:
        record["dtype"] = "bfloat16"
    with count_collectives() as counter:
        try:
            check_ranks_agree(mesh, record, what="test: ranks disagree")
        except RanksDisagreeError as exc:
            return {"error": str(exc), "calls": dict(counter.calls)}
    return {"error": None, "calls": dict(counter.calls)}


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_agreeing_ranks_cost_one_small_all_gather_per_axis(shape: tuple[int, ...]) -> None:
    for outcome in run_threaded(_agree, 4, shape, None, timeout=30):
        assert outcome["error"] is None
        assert outcome["calls"] == {"all_gather_single": len(shape)}, outcome


@pytest.mark.parametrize("shape", [(4,), (2, 2)])
def test_one_disagreeing_rank_gives_every_rank_the_same_named_error(
    shape: tuple[int, ...],
) -> None:
    outcomes = run_threaded(_agree, 4, shape, 2, timeout=30)
    messages = {str(o["error"]) for o in outcomes}
    assert len(messages) == 1, messages  # the same verdict, worded the same, everywhere
    text = messages.pop()
    assert text.startswith("test: ranks disagree\n"), text
    assert "dtype: ranks [0, 1, 3] have 'float32', ranks [2] have 'bfloat16'" in text, text
    assert "layout" not in text  # keys that agree are not listed


def _records(rank: int, world: int) -> object:
    group = dist.new_group([0, 1, 2])
    if rank == 3:
        return None
    return gather_records_if_different(group, {"path": f"/ckpt/{'x' if rank else 'y'}"})


def test_a_process_group_and_its_global_ranks() -> None:
    outcomes = run_threaded(_records, 4, timeout=30)
    want = [(0, {"path": "/ckpt/y"}), (1, {"path": "/ckpt/x"}), (2, {"path": "/ckpt/x"})]
    assert outcomes[:3] == [want] * 3, outcomes


def test_without_a_process_group_the_record_agrees_with_itself() -> None:
    assert gather_records_if_different(None, {"a": "b"}) is None
