"""The scripts of ``examples/trainers/`` run as their page says (``torchrun --standalone
--nproc-per-node 2``, here ``python -m torch.distributed.run``, which is torchrun): each exits 0
and prints ``ok``, which it prints only after asserting that its model was sharded by
fsdp_engine through torch's FSDP2 names. Their losses against FSDP2's are the other
``test_trainers_*.py`` files' business."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trainer_workers as tw

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "examples" / "trainers").glob("*_fsdp2.py"))


def test_every_trainer_example_is_run_here() -> None:
    assert SCRIPTS == [
        "accelerate_fsdp2.py",
        "hf_trainer_fsdp2.py",
        "lightning_fsdp2.py",
        "torchtitan_fsdp2.py",
    ]


@pytest.mark.parametrize("script", SCRIPTS)
def test_trainer_example_runs_under_torchrun(script: str, tmp_path: Path) -> None:
    env = {**os.environ, **tw.ENV, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "examples" / "trainers" / script),
        ],
        cwd=tmp_path,  # the scripts write nothing into the checkout
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert done.stdout.splitlines()[-1] == "ok", output[-6000:]
    assert "loss" in done.stdout
