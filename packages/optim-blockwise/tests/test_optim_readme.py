"""The README's examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index: int) -> None:
    # Run as a module named like this test file so run_threaded can find module-level functions.
    namespace: dict[str, object] = {"__name__": f"optim_readme_example_{index}"}
    exec(compile(BLOCKS[index], f"README.md[{index}]", "exec"), namespace)
