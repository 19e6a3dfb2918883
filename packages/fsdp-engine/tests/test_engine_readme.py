"""The README's example runs as written."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragged_dtensor.testing import run_markdown_example

README = Path(__file__).resolve().parents[1] / "README.md"


@pytest.mark.multiprocess
def test_readme_example_runs() -> None:
    assert run_markdown_example(README).strip().endswith("ok")


@pytest.mark.multiprocess
def test_readme_conditional_compute_example_runs() -> None:
    assert run_markdown_example(README, index=1).strip().endswith("ok")
