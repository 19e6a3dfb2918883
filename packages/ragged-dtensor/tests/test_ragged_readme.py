"""The README's example is the file it names, and that file runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragged_dtensor.testing import run_readme_example

PACKAGE = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_readme_example_is_the_file_and_runs() -> None:
    out = run_readme_example(PACKAGE / "README.md", PACKAGE / "examples" / "quickstart.py")
    assert out.strip().endswith("ok")
