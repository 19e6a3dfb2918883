"""The command line and the README example."""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import shard_planner as sp
from shard_planner.projection._private.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"


def test_report_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["report", "--model", "gpt-oss-120b", "--world", "64,256", "--block-rows", "1,128x128"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.startswith("| model | m | block | ours % |")
    assert len(out.strip().splitlines()) == 2 + 4
    assert main([*args, "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(r["world_size"], r["granularity"]) for r in rows} == {
        (64, "1"),
        (64, "128x128"),
        (256, "1"),
        (256, "128x128"),
    }
    for r in rows:
        assert r["lower_bound"] <= r["ours"] <= r["naive"] + 1e-9
        assert r["plan_ms"] >= 0


def test_plan_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    specs = [{"numel": 4096 * 3, "block": 4096, "name": "w"}, {"numel": 10, "name": "b"}]
    path = tmp_path / "specs.json"
    path.write_text(json.dumps(specs))
    assert main(["plan", str(path), "--world", "4", "--align", "8"]) == 0
    out = json.loads(capsys.readouterr().out)
    expected = sp.plan([sp.TensorSpec(4096 * 3, 4096, "w"), sp.TensorSpec(10, 1, "b")], 4, 8)
    assert out["shard_size"] == expected.shard_size
    assert out["fingerprint"] == expected.fingerprint
    assert out["lower_bound"] <= out["shard_size"]


def test_errors_exit_2_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"numel": 10, "block": 4, "name": "w"}]))
    assert main(["plan", str(path), "--world", "2"]) == 2
    assert "block 4 must divide numel 10" in capsys.readouterr().err
    assert main(["report", "--model", "llama3-8b", "--world", "0", "--block-rows", "1"]) == 2
    assert main(["report", "--model", "llama3-8b", "--world", "8", "--block-rows", "a"]) == 2


def test_models_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "deepseek-v3-671b: 671.03B parameters" in out


@pytest.mark.parametrize(("index", "name"), [(0, "quickstart.py"), (1, "projection.py")])
def test_readme_examples_are_the_files_and_run(index: int, name: str) -> None:
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    example = README.parent / "examples" / name
    assert len(blocks) > index and blocks[index] == example.read_text(), (
        f"README's example {index} is not {example}"
    )
    done = subprocess.run(
        [sys.executable, str(example)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr


def test_the_console_script_is_the_subpackage_cli() -> None:
    """pyproject's ``shard-planner`` entry point names an importable ``main`` (this one)."""
    pyproject = README.parent / "pyproject.toml"
    target = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["scripts"]
    module, _, attr = target["shard-planner"].partition(":")
    assert module.startswith("shard_planner.projection.")
    assert getattr(importlib.import_module(module), attr) is main
