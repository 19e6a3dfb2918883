"""``examples/hf_train.py`` end to end (2 gloo processes it spawns itself): the side-by-side run
of both engines and the save -> export -> from_pretrained path of its command line."""

from __future__ import annotations

import json
from pathlib import Path

import hf_workers as hw
import pytest

pytestmark = pytest.mark.multiprocess


def _main(argv: list[str]) -> None:
    import hf_train

    hf_train.main(argv)


# CI budget: nox -s hf_slow (the command-line save/export test runs the script in CI)
@pytest.mark.slow
def test_both_engines_side_by_side(tmp_path: Path) -> None:
    """Same init and batches for both engines: their losses agree within ``LOSS_TOL`` (kind (b)
    of [Note: tolerances of the HF tests]); the summary has the side-by-side ratios."""
    short = ["--steps", "4", "--eval-every", "2", "--seq-len", "64"]
    _main(["--engine", "both", *short, "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "hf_summary.json").read_text())
    ours, theirs = summary["fsdp-engine"], summary["fsdp2"]
    assert len(ours["losses"]) == len(theirs["losses"]) == 4
    hw.assert_losses_close(ours["losses"], theirs["losses"], "hf_train both engines")
    side = summary["side_by_side"]
    assert side["step_ratio_median"] > 0 and side["peak_live_ratio"] > 0
    assert all(p > 0 for p in ours["peak_live_bytes"] + theirs["peak_live_bytes"])
    assert (tmp_path / "hf_loss.png").is_file()


def test_save_and_export_from_the_command_line(tmp_path: Path) -> None:
    out = tmp_path / "exported"
    save = ["--save", str(tmp_path / "ckpt"), "--export", str(out)]
    _main(["--steps", "3", "--seq-len", "64", *save, "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "hf_summary.json").read_text())
    assert summary["export"]["bitwise_equal_logits"] is True
    assert {"config.json", "model.safetensors"} <= set(summary["export"]["files"])


def test_bad_arguments_stop_before_any_process_starts(capsys: pytest.CaptureFixture[str]) -> None:
    import hf_train

    for argv, named in (
        (["--engine", "both", "--save", "x"], "--engine"),
        (["--export", "x"], "--export"),
        (["--steps", "1"], "--steps"),
    ):
        with pytest.raises(SystemExit) as exc:
            hf_train.parse(argv, env={})
        assert exc.value.code == 2
        assert named in capsys.readouterr().err
