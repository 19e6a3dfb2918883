"""A rank that dies after the commit makes the save raise ``AfterCommitError`` (the checkpoint IS
committed), not the raw connection error of the broadcast that shares the outcome
([Note: commit protocol], phase 4).

Real gloo processes: rank 1 dies (``os._exit``) once rank 0's ``COMMITTED`` marker is in place,
before the outcome's broadcast; rank 0 records what its save raised in a file (the harness
reports the dead rank, not the survivor's return value).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from fsdp_engine import (
    AfterCommitError,
    async_save_checkpoint,
    latest_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from fsdp_engine._private import checkpoint_files
from ragged_dtensor.testing import DistributedFailure, run_processes


def _save_and_die(rank: int, world: int, root: str, mode: str) -> None:
    final = Path(root) / "step_00000001"
    if rank == 1:
        real_gather = checkpoint_files.gather_digests

        def gather_then_die(*args: Any, **kwargs: Any) -> Any:
            out = real_gather(*args, **kwargs)
            deadline = time.monotonic() + 60
            while not (final / "COMMITTED").is_file() and time.monotonic() < deadline:
                time.sleep(0.05)  # rank 0 commits: the marker lands in the final directory
            os._exit(0)  # killed after the commit, before the outcome's broadcast
            return out  # pragma: no cover

        checkpoint_files.gather_digests = gather_then_die  # type: ignore[assignment]
    state = {"w": torch.arange(8.0)}
    try:
        if mode == "async":
            async_save_checkpoint(state, final).result(timeout=120)
        else:
            save_checkpoint(state, final)
        outcome = {"type": "returned", "message": ""}
    except Exception as exc:
        outcome = {"type": type(exc).__name__, "message": str(exc)}
    Path(root, f"rank{rank}.json").write_text(json.dumps(outcome))


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rank_dying_after_the_commit_gives_after_commit_error(tmp_path: Path, mode: str) -> None:
    with pytest.raises(DistributedFailure, match=r"ranks \[1\] exited without reporting"):
        run_processes(_save_and_die, 2, str(tmp_path), mode, timeout=120)
    outcome = json.loads((tmp_path / "rank0.json").read_text())
    assert outcome["type"] == AfterCommitError.__name__, outcome
    final = tmp_path / "step_00000001"
    assert f"{str(final)!r} IS committed and loadable" in outcome["message"], outcome
    assert "sharing the outcome with every rank failed after the commit" in outcome["message"]
    assert not (tmp_path / "rank1.json").exists()  # rank 1 died in the save
    assert latest_checkpoint(tmp_path) == final
    verify_checkpoint(final)  # committed, every byte as recorded
