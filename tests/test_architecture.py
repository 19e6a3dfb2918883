"""The dependency table of DEVELOPERS.md, enforced on the source of every package.

- each package imports only the standard library, itself and what its pyproject declares;
- sibling packages only in the allowed directions (table below);
- never another package's ``_private`` modules;
- shard-planner never imports torch.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"

# import name -> siblings it may import (the table in DEVELOPERS.md)
ALLOWED_SIBLINGS: dict[str, set[str]] = {
    "ragged_dtensor": set(),
    "shard_planner": set(),
    "dbuffer": {"ragged_dtensor"},
    "fsdp_engine": {"ragged_dtensor", "shard_planner", "dbuffer"},
    "optim_blockwise": {"ragged_dtensor"},
}
# distribution name -> import name, where they differ beyond '-' -> '_'
IMPORT_NAME = {"pyyaml": "yaml", "attrs": "attrs"}


def _dist_to_import(dist: str) -> str:
    dist = dist.lower()
    return IMPORT_NAME.get(dist, dist.replace("-", "_"))


def _requirement_name(requirement: str) -> str:
    name = requirement
    for stop in "<>=!~[; ":
        name = name.split(stop, 1)[0]
    return name.strip().lower()


def _package_folders() -> list[Path]:
    return sorted(p for p in PACKAGES.iterdir() if (p / "pyproject.toml").is_file())


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return found


def _declared(folder: Path) -> tuple[str, set[str]]:
    with (folder / "pyproject.toml").open("rb") as fh:
        project = tomllib.load(fh)["project"]
    deps = {_dist_to_import(_requirement_name(d)) for d in project.get("dependencies", [])}
    return _dist_to_import(project["name"]), deps


def _optional(folder: Path) -> set[str]:
    """Third-party imports an optional extra (other than ``test``) declares, e.g. matplotlib
    for shard-planner's ``plot``: a module may import them (the package works without)."""
    with (folder / "pyproject.toml").open("rb") as fh:
        extras = tomllib.load(fh)["project"].get("optional-dependencies", {})
    return {
        _dist_to_import(_requirement_name(d))
        for name, reqs in extras.items()
        if name != "test"
        for d in reqs
    }


def test_every_package_is_in_the_table() -> None:
    names = {_declared(f)[0] for f in _package_folders()}
    assert names, "no packages found"
    assert names <= set(ALLOWED_SIBLINGS), (
        f"packages missing from the table: {names - set(ALLOWED_SIBLINGS)}"
    )


@pytest.mark.parametrize("folder", _package_folders(), ids=lambda p: p.name)
def test_imports_follow_the_dependency_table(folder: Path) -> None:
    name, declared = _declared(folder)
    siblings = set(ALLOWED_SIBLINGS)
    problems = []
    for path in sorted((folder / "src").rglob("*.py")):
        for lineno, module in _imports(path):
            root = module.split(".")[0]
            where = f"{path.relative_to(ROOT)}:{lineno} imports {module}"
            if root == name or root in sys.stdlib_module_names or root == "__future__":
                continue
            if root in siblings:
                if root not in ALLOWED_SIBLINGS[name]:
                    problems.append(f"{where}: {name} may not depend on {root}")
                elif "._private" in module or module.split(".")[1:2] == ["_private"]:
                    problems.append(f"{where}: private module of another package")
                if root not in declared:
                    problems.append(f"{where}: sibling {root} not declared in pyproject")
                continue
            if root not in declared and root not in _optional(folder):
                problems.append(f"{where}: {root} is not a declared dependency of {name}")
    assert not problems, "\n".join(problems)


def test_shard_planner_never_imports_torch() -> None:
    folder = PACKAGES / "shard-planner"
    if not folder.exists():
        pytest.fail("packages/shard-planner is missing")
    offenders = [
        f"{p}:{ln} {m}"
        for p in (folder / "src").rglob("*.py")
        for ln, m in _imports(p)
        if m.split(".")[0] == "torch"
    ]
    assert not offenders, offenders


@pytest.mark.parametrize("folder", _package_folders(), ids=lambda p: p.name)
def test_package_layout(folder: Path) -> None:
    name, _ = _declared(folder)
    src = folder / "src" / name
    for required in (
        src / "__init__.py",
        src / "py.typed",
        folder / "README.md",
        folder / "CHANGELOG.md",
    ):
        assert required.is_file(), f"{required.relative_to(ROOT)} is missing"
    init = ast.parse((src / "__init__.py").read_text())
    assigned = {
        t.id
        for n in ast.walk(init)
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    assert "__all__" in assigned, f"{name}/__init__.py must define __all__"
    assert "__version__" in assigned, f"{name}/__init__.py must define __version__"
