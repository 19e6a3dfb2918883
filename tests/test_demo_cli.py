"""The demo's command line: every bad value is one argparse line and exit status 2, before any
process is spawned; a --world-size that disagrees with torchrun's is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
sys.path.insert(0, str(EXAMPLES))

import demo  # noqa: E402  (the examples folder is not a package)

BAD = {
    "--world-size 0": (["--world-size", "0"], "--world-size: must be at least 1, got 0"),
    "--world-size -1": (["--world-size", "-1"], "--world-size: must be at least 1, got -1"),
    "--batch-size 0": (["--batch-size", "0"], "--batch-size: must be at least 1, got 0"),
    "--seq-len too long": (["--seq-len", "10000000"], "--seq-len: 10000000 is longer than"),
    "--lr -1": (["--lr", "-1"], "--lr: must be a positive finite number, got -1"),
    "--lr nan": (["--lr", "nan"], "--lr: must be a positive finite number, got nan"),
    "--threads 0": (["--threads", "0"], "--threads: must be at least 1, got 0"),
    "--steps 1": (["--steps", "1"], "--steps: must be at least 2, got 1"),
    "--steps x": (["--steps", "x"], "--steps: not an integer: 'x'"),
    "--eval-every 0": (["--eval-every", "0"], "--eval-every: must be at least 1, got 0"),
    "--timeout 0": (["--timeout", "0"], "--timeout: must be a positive finite number, got 0"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_argument_is_one_line_and_exit_2(case: str, capsys: Any) -> None:
    argv, fragment = BAD[case]
    with pytest.raises(SystemExit) as exit_info:
        demo.parse(argv, env={})
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def test_world_size_must_agree_with_torchrun(capsys: Any) -> None:
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    with pytest.raises(SystemExit) as exit_info:
        demo.parse(["--world-size", "4"], env=torchrun)
    assert exit_info.value.code == 2
    assert "--world-size: 4 conflicts with torchrun's world size 2" in capsys.readouterr().err
    args = demo.parse([], env=torchrun)  # no --world-size: torchrun's
    assert args.torchrun and args.world_size == 2
    assert demo.parse(["--world-size", "2"], env=torchrun).world_size == 2


def test_defaults_spawn_two_ranks_into_an_ignored_folder() -> None:
    args = demo.parse([], env={})
    assert not args.torchrun and args.world_size == 2
    assert Path(args.out).parts[0] == "runs"
    ignored = (EXAMPLES.parent / ".gitignore").read_text().split()
    assert "runs/" in ignored


def test_the_real_exit_status_is_2() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--batch-size", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done
    assert done.stderr.strip().splitlines() == [
        "demo.py: error: argument --batch-size: must be at least 1, got 0 "
        "(--help lists the options)"
    ]
