"""run_processes starts all ranks again when one fails before the test body (the startup retry)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from ragged_dtensor._private.processes import STARTUP_FAULT_ENV
from ragged_dtensor.testing import DistributedFailure, run_processes


def _sum_of_ranks(rank: int, world_size: int) -> float:
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    return float(value.item())


@pytest.mark.timeout(300)
def test_a_startup_failure_starts_every_rank_again(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "failed-once"
    env = {STARTUP_FAULT_ENV: str(marker)}
    results = run_processes(_sum_of_ranks, 2, env=env, timeout=120)
    assert results == [1.0, 1.0]  # the body ran once, on a group that started cleanly
    assert marker.exists()  # the fault fired, so the first start did fail
    assert "failed at startup (attempt 1 of 3)" in capfd.readouterr().err


@pytest.mark.timeout(600)
def test_a_rank_that_never_starts_is_named_after_the_last_attempt() -> None:
    env = {"GLOO_SOCKET_IFNAME": "no-such-interface0"}
    with pytest.raises(DistributedFailure, match=r"failed to start 3 times in a row") as info:
        run_processes(_sum_of_ranks, 1, env=env, timeout=60)
    assert "(startup)" in str(info.value)
