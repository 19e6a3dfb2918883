"""The README's examples are the files they name, and those files run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ragged_dtensor.testing import run_readme_example

PACKAGE = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("index", "name"), [(0, "quickstart.py"), (1, "sharded.py"), (2, "shampoo_soap.py")]
)
def test_readme_example_is_the_file_and_runs(index: int, name: str) -> None:
    run_readme_example(PACKAGE / "README.md", PACKAGE / "examples" / name, index=index)
