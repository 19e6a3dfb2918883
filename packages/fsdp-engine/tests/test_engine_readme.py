"""The README's example runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragged_dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", [0, 1], ids=["training", "checkpoints"])
def test_readme_example_runs(index: int) -> None:
    assert run_markdown_example(README, index=index).strip().endswith("ok")
