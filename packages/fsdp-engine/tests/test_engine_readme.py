"""The README's examples are the files they name, and those files run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragged_dtensor.testing import run_readme_example

PACKAGE = Path(__file__).resolve().parents[1]


@pytest.mark.multiprocess
def test_readme_example_is_the_file_and_runs() -> None:
    out = run_readme_example(PACKAGE / "README.md", PACKAGE / "examples" / "quickstart.py")
    assert out.strip().endswith("ok")


@pytest.mark.slow  # CI budget; test_engine_conditional.py runs the same routing on gloo
@pytest.mark.multiprocess
def test_readme_conditional_compute_example_is_the_file_and_runs() -> None:
    example = PACKAGE / "examples" / "conditional_compute.py"
    out = run_readme_example(PACKAGE / "README.md", example, index=1)
    assert out.strip().endswith("ok")


# CI budget: the same save/resume/damage paths run in test_engine_reliability_checkpoint.py
@pytest.mark.slow
@pytest.mark.multiprocess
def test_readme_checkpoint_example_is_the_file_and_runs() -> None:
    example = PACKAGE / "examples" / "checkpoints.py"
    out = run_readme_example(PACKAGE / "README.md", example, index=2)
    assert out.strip().endswith("ok")
