"""Module and class sizes, enforced on the source of every package: a module of a few hundred
lines, one concern each (DEVELOPERS.md, "Style"). No source module over ``MODULE_LINES`` lines and
no class over ``CLASS_LINES``, but for the named gaps in ``KNOWN_OVER``, which may not grow; the
check itself is tested on planted oversized sources."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
MODULE_LINES = 400
CLASS_LINES = 300
# What is still over a limit, with the size it may not exceed: each entry is a named gap (the
# test fails when one grows, and when one no longer needs its entry).
KNOWN_OVER: dict[str, int] = {
    # the reduce side's one class: strategies are chosen once (reduce_comm.py), but its
    # accumulation, compact (frozen-parameter) and hand-over paths still live in it
    "packages/fsdp-engine/src/fsdp_engine/_private/reduce.py:GradReducer": 339,
}


def _source_modules() -> list[Path]:
    return sorted(PACKAGES.glob("*/src/**/*.py"))


def oversized(source: str, name: str) -> dict[str, tuple[int, int]]:
    """What in one module's source breaks the limits: ``"<name>"`` or ``"<name>:<Class>"`` to
    (size in lines, limit)."""
    found: dict[str, tuple[int, int]] = {}
    lines = source.count("\n") + (0 if source.endswith("\n") or not source else 1)
    if lines > MODULE_LINES:
        found[name] = (lines, MODULE_LINES)
    for node in ast.walk(ast.parse(source, filename=name)):
        if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            size = node.end_lineno - first + 1
            if size > CLASS_LINES:
                found[f"{name}:{node.name}"] = (size, CLASS_LINES)
    return found


def test_no_source_module_or_class_over_the_limits() -> None:
    modules = _source_modules()
    assert len(modules) > 50  # the glob found the packages' sources
    found: dict[str, tuple[int, int]] = {}
    for path in modules:
        found.update(oversized(path.read_text(), str(path.relative_to(ROOT))))
    grown = [
        f"{what}: {size} lines (at most {KNOWN_OVER.get(what, limit)})"
        for what, (size, limit) in sorted(found.items())
        if size > KNOWN_OVER.get(what, limit)
    ]
    assert not grown, "split by concern:\n" + "\n".join(grown)
    stale = sorted(set(KNOWN_OVER) - set(found))
    assert not stale, f"within the limits now; remove from KNOWN_OVER: {stale}"


def test_the_check_finds_a_planted_long_module_and_class() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    source = f"class Big:\n{body}\n" + "y = 0\n" * (MODULE_LINES - CLASS_LINES)
    assert oversized(source, "planted.py") == {
        "planted.py": (MODULE_LINES + 1, MODULE_LINES),
        "planted.py:Big": (CLASS_LINES + 1, CLASS_LINES),
    }
    assert oversized("class Small:\n    pass\n", "small.py") == {}
