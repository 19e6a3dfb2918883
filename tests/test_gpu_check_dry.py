"""``benchmarks/gpu_check.sh --dry``: the GPU check's every step on CPU/gloo, tiny, so the script
cannot rot between the runs on a GPU machine (parity runs, race runs, the host benchmark, the
report and its pass/fail verdict)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # CI budget (19 s): the device script runs only when a GPU is lent
def test_gpu_check_dry_run_passes(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--dry", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "result: passed" in summary
    assert "- not run (no CUDA in --dry)" in summary  # the sanitizer step is CUDA only
    for case in ("fp32", "bf16"):
        ours = json.loads((tmp_path / f"parity_ours_{case}.json").read_text())
        theirs = json.loads((tmp_path / f"parity_fsdp2_{case}.json").read_text())
        assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == 3
    races = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("race_*.json"))]
    assert len(races) == 3
    # the race runs take every collective path: rank 0 of 4 on the fake process group
    assert all(r["world"] == 4 and r["losses"] == races[0]["losses"] for r in races)
    host = json.loads((tmp_path / "scale_host.json").read_text())
    assert {r["world"] for r in host["rows"]} == {8, 64}
    assert {r["engine"] for r in host["rows"]} == {"ours", "fsdp2"}


def test_gpu_check_report_fails_on_a_difference(tmp_path: Path) -> None:
    """The report's verdict is real: a loss that differs in its last bit fails it."""
    run = {"steps": 1, "launch_blocking": "0", "losses": [(1.0).hex()], "params_sha256": "x"}
    for engine in ("ours", "fsdp2"):
        for case in ("fp32", "bf16"):
            (tmp_path / f"parity_{engine}_{case}.json").write_text(json.dumps(run))
    for name in ("a", "b", "c"):
        (tmp_path / f"race_{name}.json").write_text(json.dumps(run))
    (tmp_path / "sanitizer.txt").write_text("FAILED (see sanitizer.log)\n")
    (tmp_path / "sanitizer.log").write_text("CUDASanitizerErrors: a data race\n")
    other = dict(run, losses=[(1.0 + 2**-52).hex()])
    (tmp_path / "race_b.json").write_text(json.dumps(other))
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "report",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "result: FAILED: race race_b, sanitizer" in proc.stdout
    assert "CUDASanitizerErrors: a data race" in proc.stdout
