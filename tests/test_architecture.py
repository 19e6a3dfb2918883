"""The dependency table of DEVELOPERS.md, enforced on the source of every package.

- each package imports only the standard library, itself and what its pyproject declares;
- sibling packages only in the allowed directions (table below);
- never another package's ``_private`` modules, nor its ``testing`` module (test conveniences
  and measurement: ``dbuffer.testing``, ``ragged_dtensor.testing``; no package uses them);
- shard-planner never imports torch;
- shard-planner's ``projection`` subpackage reaches the packing core only through the core's
  public API (``shard_planner.<name>`` for a name in ``shard_planner.__all__``), and the core
  never imports the subpackage;
- no test module imports another test module (shared helpers live in modules pytest does not
  collect), and every ``test_*.py`` holds a test.
"""

from __future__ import annotations

import ast
import shutil
import sys
import tomllib
from collections.abc import Iterator, Mapping
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
                elif module.split(".")[1:2] == ["testing"]:
                    problems.append(f"{where}: test tools of another package")
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


# [Note: the planner's core and its projection subpackage]
# shard-planner is a packing core (``shard_planner``: spec, plan, search, exact, bounds, orders,
# align, baselines) and a subpackage ``shard_planner.projection`` (catalogue, hardware,
# projection, advisor, report, plots, CLI) that a user of the core never needs. The line: the
# subpackage uses the core only as any user would, through the names ``shard_planner/__init__.py``
# exports in ``__all__`` (so the core's private modules can change freely), and the core never
# imports the subpackage (so ``import shard_planner`` stays the packing core alone). Every way a
# module can name another counts: ``import``, ``from ... import`` (relative ones resolved),
# attributes of a bound ``shard_planner`` (``sp._private``), and literal
# ``importlib.import_module`` / ``__import__`` arguments.
PLANNER = "shard_planner"
PLANNER_SUBPACKAGE = "shard_planner.projection"
PLANNER_SRC = PACKAGES / "shard-planner" / "src"


def _dunder_all(source: str, filename: str) -> set[str]:
    """The string literals of ``__all__ = [...]`` (or a tuple) in a module's source."""
    for node in ast.walk(ast.parse(source, filename=filename)):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            if not isinstance(node.value, ast.List | ast.Tuple):
                raise AssertionError(f"{filename}: __all__ must be a literal list or tuple")
            return {
                e.value
                for e in node.value.elts
                if isinstance(e, ast.Constant) and isinstance(e.value, str)
            }
    raise AssertionError(f"{filename}: no __all__")


def _named_modules(rel_path: str, tree: ast.Module) -> Iterator[tuple[int, str, set[str]]]:
    """``(line, module, names)`` for every import in a module at ``rel_path`` (a ``/`` path
    under ``src``): relative imports resolved against the module's package; ``names`` are the
    names taken from the module by ``from ... import`` (empty for ``import``); a relative
    import climbing above the top-level package yields the module ``<beyond top level>``."""
    package = rel_path.removesuffix(".py").split("/")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, set()
        elif isinstance(node, ast.ImportFrom):
            names = {alias.name for alias in node.names}
            if node.level == 0:
                yield node.lineno, node.module or "", names
                continue
            up = node.level - 1
            if up >= len(package):
                yield node.lineno, "<beyond top level>", names
                continue
            base = package[: len(package) - up]
            yield node.lineno, ".".join([*base, *([node.module] if node.module else [])]), names
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (
                    isinstance(node.func, ast.Name)
                    and node.func.id in {"import_module", "__import__"}
                )
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield node.lineno, node.args[0].value, set()


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def planner_layering_problems(files: Mapping[str, str], core_public: set[str]) -> list[str]:
    """Breaches of the line between shard-planner's core and its projection subpackage.

    ``files`` maps each module's ``/`` path under ``src`` (``shard_planner/projection/x.py``) to
    its source; ``core_public`` is the core's ``__all__``. Files outside ``shard_planner`` are
    ignored. Returns one ``path:line: what`` string per breach.
    """
    sub_dir = PLANNER_SUBPACKAGE.replace(".", "/") + "/"
    problems: list[str] = []
    for rel_path, source in sorted(files.items()):
        if not rel_path.startswith(PLANNER + "/"):
            continue
        tree = ast.parse(source, filename=rel_path)
        in_sub = rel_path.startswith(sub_dir)
        for lineno, module, names in _named_modules(rel_path, tree):
            where = f"{rel_path}:{lineno}"
            # ``from shard_planner import projection`` names the subpackage too
            targets = {module} | {f"{module}.{n}" for n in names if module == PLANNER}
            if module == "<beyond top level>":
                problems.append(f"{where}: relative import above the top-level package")
            elif not in_sub:
                if any(_within(t, PLANNER_SUBPACKAGE) for t in targets):
                    problems.append(
                        f"{where}: the core imports {PLANNER_SUBPACKAGE} ({module}); "
                        "the core must not depend on its subpackage"
                    )
            elif module == PLANNER:
                private = sorted(n for n in names if n not in core_public and n != "projection")
                if private:
                    problems.append(
                        f"{where}: imports {private} from {PLANNER}, not in its __all__ "
                        "(the subpackage may use only the core's public API)"
                    )
            elif _within(module, PLANNER) and not _within(module, PLANNER_SUBPACKAGE):
                problems.append(
                    f"{where}: imports {module}, inside the core; the subpackage may use only "
                    f"the core's public API (from {PLANNER} import <name in __all__>)"
                )
        if not in_sub:
            continue
        # ``import shard_planner as sp`` then ``sp._private...``: attributes of the bound core
        bound = {
            alias.asname or PLANNER
            for node in ast.walk(tree)
            if isinstance(node, ast.Import)
            for alias in node.names
            if (alias.asname and alias.name == PLANNER)
            or (not alias.asname and _within(alias.name, PLANNER))
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in bound
                and node.attr not in core_public
                and node.attr != "projection"
            ):
                problems.append(
                    f"{rel_path}:{node.lineno}: uses {node.value.id}.{node.attr}, not in "
                    f"{PLANNER}.__all__ (the subpackage may use only the core's public API)"
                )
    return problems


def _planner_sources(src: Path) -> dict[str, str]:
    return {p.relative_to(src).as_posix(): p.read_text() for p in sorted(src.rglob("*.py"))}


def _core_public(files: Mapping[str, str]) -> set[str]:
    init = f"{PLANNER}/__init__.py"
    return _dunder_all(files[init], init)


def test_shard_planner_core_and_projection_keep_their_line() -> None:
    files = _planner_sources(PLANNER_SRC)
    sub_dir = PLANNER_SUBPACKAGE.replace(".", "/") + "/"
    sub_files = [p for p in files if p.startswith(sub_dir)]
    core_files = [p for p in files if p.startswith(PLANNER + "/") and not p.startswith(sub_dir)]
    assert f"{sub_dir}__init__.py" in sub_files, f"{PLANNER_SUBPACKAGE} is missing"
    assert len(core_files) > 1, "the planner's core is missing"
    public = _core_public(files)
    # not vacuous: the subpackage does use the core, through its public names
    uses_core = [
        (path, module)
        for path in sub_files
        for _, module, names in _named_modules(path, ast.parse(files[path]))
        if module == PLANNER and names & public
    ]
    assert uses_core, f"{PLANNER_SUBPACKAGE} never imports the core's public API"
    problems = planner_layering_problems(files, public)
    assert not problems, "\n".join(problems)


CORE_PUBLIC = {"plan", "TensorSpec", "Plan", "lower_bound"}
SUB = "shard_planner/projection/_private/report.py"
SUB_INIT = "shard_planner/projection/__init__.py"
CORE = "shard_planner/_private/search.py"
CORE_INIT = "shard_planner/__init__.py"


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        # the subpackage reaching into the core's private modules
        (SUB, "from shard_planner._private.search import plan\n", "shard_planner._private.search"),
        (SUB, "import shard_planner._private.spec\n", "shard_planner._private.spec"),
        (SUB, "from ..._private.spec import TensorSpec\n", "shard_planner._private.spec"),
        (SUB_INIT, "from .._private import search\n", "shard_planner._private"),
        (SUB, "import shard_planner as sp\nx = sp._private.search\n", "sp._private"),
        (SUB, "import shard_planner.projection\nx = shard_planner._private\n", "._private"),
        (SUB, "from shard_planner import check_inputs\n", "check_inputs"),
        (SUB, "from .... import plan\n", "above the top-level package"),
        (
            SUB,
            "import importlib\nimportlib.import_module('shard_planner._private.plan')\n",
            "_private.plan",
        ),
        (SUB, "def f():\n    from shard_planner._private import exact\n", "shard_planner._private"),
        # the core importing the subpackage
        (CORE, "from shard_planner.projection import MODELS\n", "the core imports"),
        (CORE, "from shard_planner import projection\n", "the core imports"),
        (CORE, "import shard_planner.projection._private.cli\n", "the core imports"),
        (CORE_INIT, "from .projection import project\n", "the core imports"),
        (CORE, "from ..projection._private.catalogue import Model\n", "the core imports"),
        (CORE, "def f():\n    import shard_planner.projection\n", "the core imports"),
        (CORE, "__import__('shard_planner.projection')\n", "the core imports"),
    ],
)
def test_planner_layering_check_rejects_a_planted_breach(
    path: str, source: str, expected: str
) -> None:
    problems = planner_layering_problems({path: source}, CORE_PUBLIC)
    assert len(problems) == 1, problems
    assert path in problems[0] and expected in problems[0], problems


@pytest.mark.parametrize(
    ("path", "source"),
    [
        (SUB, "from shard_planner import TensorSpec, plan\nimport shard_planner as sp\nsp.plan\n"),
        (SUB, "from shard_planner.projection._private.catalogue import Model\n"),
        (SUB, "from .catalogue import Model\nfrom .. import Setup\n"),
        (SUB_INIT, "from shard_planner import projection\n"),
        (CORE, "from shard_planner._private.spec import TensorSpec\nfrom .plan import Plan\n"),
        (CORE_INIT, "from shard_planner._private.search import plan\n"),
        ("other_package/x.py", "from shard_planner._private.search import plan\n"),
    ],
)
def test_planner_layering_check_accepts_the_allowed_imports(path: str, source: str) -> None:
    assert planner_layering_problems({path: source}, CORE_PUBLIC) == []


def test_planner_layering_check_finds_a_breach_planted_in_the_real_tree(tmp_path: Path) -> None:
    """A copy of the real source with one breach planted on each side: both named, nothing
    else (so the real tree's files are read and classified as the check expects)."""
    src = tmp_path / "src"
    shutil.copytree(PLANNER_SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    report = src / "shard_planner" / "projection" / "_private" / "report.py"
    report.write_text(report.read_text() + "\nfrom shard_planner._private.bounds import round_up\n")
    search = src / "shard_planner" / "_private" / "search.py"
    search.write_text(search.read_text() + "\nfrom shard_planner.projection import MODELS\n")
    files = _planner_sources(src)
    problems = planner_layering_problems(files, _core_public(files))
    assert len(problems) == 2, problems
    assert any("projection/_private/report.py" in p and "_private.bounds" in p for p in problems)
    assert any(
        "shard_planner/_private/search.py" in p and "the core imports" in p for p in problems
    )


# [Note: test modules import no test module]
# A test module imported by another runs its module-level code twice (collected, and imported by
# name), hides where a helper lives, and ties two test files together; a spawned process
# re-imports test modules by name, so the helper's home must be a module of its own. Shared code
# goes in a module pytest does not collect (``engine_*.py``, ``dbuffer_*.py``, ``tests/*.py``
# not named ``test_*``); across packages, only through a package's public API (e.g.
# ``dbuffer.testing``). Every way of naming a module counts, as for the planner's line above.
TEST_DIRS = [ROOT / "tests", ROOT / "examples" / "tests", *(PACKAGES.glob("*/tests"))]


def _test_files() -> dict[str, str]:
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for folder in TEST_DIRS
        if folder.is_dir()
        for path in sorted(folder.rglob("test_*.py"))
    }


def imports_of_test_modules(files: Mapping[str, str]) -> list[str]:
    """Each import in a ``test_*.py`` of ``files`` (path -> source) that names a ``test_*``
    module: ``import test_x``, ``from test_x import y``, ``from . import test_x``,
    ``importlib.import_module("test_x")``, ``__import__("test_x")``, anywhere in the file."""
    problems = []
    for path, source in files.items():
        for line, module, names in _named_modules(Path(path).name, ast.parse(source, path)):
            relative = module == "<beyond top level>" or module.split(".")[0] == "tests"
            named = module.split(".") + sorted(names) if relative else module.split(".")[:1]
            if any(part.startswith("test_") for part in named):
                problems.append(f"{path}:{line} imports the test module {module or names}")
    return problems


def test_no_test_module_imports_another_test_module() -> None:
    problems = imports_of_test_modules(_test_files())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "source",
    [
        "import test_dbuffer_streams as streams\n",
        "import test_engine_fsdp2\n",
        "from test_dbuffer_autograd import _train_step\n",
        "from test_optim_support.sub import helper\n",
        "from . import test_other\n",
        "import tests.test_architecture\n",
        "def f():\n    from test_engine_parity import check\n",
        "import importlib\nimportlib.import_module('test_engine_parity')\n",
        "__import__('test_engine_parity')\n",
    ],
    ids=[
        "import-as",
        "import",
        "from-import",
        "from-submodule",
        "relative",
        "tests-package",
        "in-a-function",
        "import_module",
        "__import__",
    ],
)
def test_the_test_import_check_rejects_a_planted_breach(source: str) -> None:
    problems = imports_of_test_modules({"packages/x/tests/test_x.py": source})
    assert len(problems) == 1 and "packages/x/tests/test_x.py" in problems[0], problems


def test_the_test_import_check_accepts_helpers_and_test_utilities() -> None:
    source = (
        "import engine_models\nfrom dbuffer_helpers import make_tensors\n"
        "from torch.testing._internal.common_utils import run_tests\n"
        "from ragged_dtensor.testing import run_threaded\n"
        "from dbuffer.testing import simulated_streams\n"
    )
    assert imports_of_test_modules({"tests/test_x.py": source}) == []


def test_every_test_module_holds_a_test() -> None:
    """A ``test_*.py`` with no test is a helper pytest collects (issue 27: ``test_optim_support.py``
    held 0 tests): name it otherwise."""
    empty = [
        path
        for path, source in _test_files().items()
        if not any(
            (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name.startswith("test")
            )
            or (isinstance(node, ast.ClassDef) and node.name.startswith("Test"))
            for node in ast.walk(ast.parse(source, path))
        )
    ]
    assert not empty, empty


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
