"""A rank SIGKILLed mid-training under ``torchrun --max-restarts=1``: the job restarts from the
last committed checkpoint and ends with the same parameters and optimizer state as an
uninterrupted run (bit for bit). Killed in a step, or in the middle of an asynchronous save
(after its own files are written, before the commit, while training has moved on): the save in
flight is never committed, and the job resumes from the checkpoint before it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from engine_reliability_common import assert_bitwise_equal

SCRIPT = Path(__file__).with_name("engine_reliability_train.py")
LIMIT_S = 240  # hard limit for each torchrun job (all three run at once)


def _torchrun(workdir: Path, name: str, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    out = workdir / f"{name}.pt"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        "--steps",
        "8",
        "--every",
        "3",
        "--ckpt",
        str(workdir / f"{name}-ckpt"),
        "--out",
        str(out),
        *extra,
    ]
    # a fresh rendezvous store per attempt (see engine_reliability_train.py)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    log = (workdir / f"{name}.log").open("w")
    proc = subprocess.Popen(
        cmd, cwd=SCRIPT.parent, env=env, stdout=log, stderr=subprocess.STDOUT, text=True
    )
    return proc, out


def _finish(proc: subprocess.Popen[str], deadline: float, log: Path) -> None:
    try:
        code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail(f"torchrun did not finish within {LIMIT_S} s:\n{log.read_text()[-4000:]}")
    assert code == 0, f"torchrun exited {code}:\n{log.read_text()[-4000:]}"


def _listing(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.mark.multiprocess
def test_killed_rank_restarts_from_the_last_checkpoint_and_matches(tmp_path: Path) -> None:
    """Three jobs at once: uninterrupted (synchronous saves at steps 3 and 6); rank 1 killed in
    step 7 (synchronous saves); rank 1 killed inside the asynchronous save of step 6 (its
    writer, once its files are on disk), with training already in step 7."""
    marker = tmp_path / "killed.marker"
    in_save = tmp_path / "killed-in-save.marker"
    start = time.monotonic()
    deadline = start + LIMIT_S
    straight, straight_out = _torchrun(tmp_path, "straight")
    killed, killed_out = _torchrun(
        tmp_path, "killed", "--kill-rank", "1", "--kill-at", "7", "--kill-marker", str(marker)
    )
    killed_async, killed_async_out = _torchrun(
        tmp_path,
        "killed-async",
        "--async-save",
        "--kill-rank",
        "1",
        "--kill-in-save",
        "6",
        "--kill-marker",
        str(in_save),
    )
    _finish(straight, deadline, tmp_path / "straight.log")
    _finish(killed, deadline, tmp_path / "killed.log")
    _finish(killed_async, deadline, tmp_path / "killed-async.log")

    assert marker.is_file(), "rank 1 never killed itself"
    assert in_save.is_file(), "rank 1 never killed itself in the asynchronous save"
    assert "in the save of step_00000006" in in_save.read_text()
    want = torch.load(straight_out)
    assert want["attempt"] == 0 and want["resumed_from"] is None
    # the restarted attempt resumed from the checkpoint taken at step 6 (the kill was in step 7)
    got = torch.load(killed_out)
    assert got["attempt"] == 1, got["attempt"]
    assert got["resumed_from"] == "step_00000006", got["resumed_from"]
    assert_bitwise_equal(got["state"], want["state"])
    assert _listing(tmp_path / "killed-ckpt") == ["latest", "step_00000003", "step_00000006"]
    # the save of step 6 died before its commit: the restart resumed from step 3, saved step 6
    # again (removing the dead partial directory) and ends bitwise equal to the uninterrupted
    # run with synchronous saves
    got = torch.load(killed_async_out)
    assert got["attempt"] == 1, got["attempt"]
    assert got["resumed_from"] == "step_00000003", got["resumed_from"]
    assert_bitwise_equal(got["state"], want["state"])
    assert _listing(tmp_path / "killed-async-ckpt") == ["latest", "step_00000003", "step_00000006"]
