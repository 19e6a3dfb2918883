"""The one task runner of the monorepo.

`nox -t ci` is what CI runs (lint, typecheck, architecture, every package's tests in its own
venv, cross-package integration). `nox -s demo` is the main job; `nox -s bench` the side-by-side
benchmarks.

Each package's test session installs only what that package declares (its sibling dependencies come
from this checkout), so an undeclared import fails there instead of passing by accident.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
TORCH = "torch==2.13.0"

nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True


def _project(folder: Path) -> dict[str, object]:
    with (folder / "pyproject.toml").open("rb") as fh:
        project: dict[str, object] = tomllib.load(fh)["project"]
    return project


def _requirement_name(requirement: str) -> str:
    name = requirement
    for stop in "<>=!~[; ":
        name = name.split(stop, 1)[0]
    return name.strip().lower().replace("_", "-")


def _packages() -> dict[str, Path]:
    """Distribution name -> folder, for every package in the monorepo."""
    found = {}
    for folder in sorted(PACKAGES.iterdir()):
        if (folder / "pyproject.toml").is_file():
            found[str(_project(folder)["name"])] = folder
    return found


def _sibling_closure(dist: str) -> list[Path]:
    """The package and every sibling it needs, dependencies first."""
    packages = _packages()
    order: list[Path] = []

    def visit(name: str) -> None:
        folder = packages[name]
        if folder in order:
            return
        deps = _project(folder).get("dependencies", [])
        assert isinstance(deps, list)
        for requirement in deps:
            sibling = _requirement_name(str(requirement))
            if sibling in packages:
                visit(sibling)
        order.append(folder)

    visit(dist)
    return order


def _needs_torch(folders: list[Path]) -> bool:
    for folder in folders:
        deps = _project(folder).get("dependencies", [])
        assert isinstance(deps, list)
        if any(_requirement_name(str(d)) == "torch" for d in deps):
            return True
    return False


TORCH_VENV = ROOT / ".nox" / "_shared_torch"


def _install_torch(session: nox.Session) -> None:
    """Make the pinned torch importable in this session's venv.

    [Note: one torch for every venv]
    torch is ~900 MB installed; installing it into each of the ~8 session venvs would cost CI
    several minutes. It is installed once into a shared venv, and each session venv gets a ``.pth``
    file naming that venv's site-packages: torch and its own dependencies become importable (and
    visible to pip, which then keeps them), nothing else does, so an undeclared import of numpy,
    attrs or a sibling package still fails in a package's test session.
    """
    shared_python = TORCH_VENV / "bin" / "python"
    if not shared_python.exists():
        session.run("python", "-m", "venv", str(TORCH_VENV), external=True)
        session.run(str(shared_python), "-m", "pip", "install", "--quiet", TORCH, external=True)
    shared_site = session.run(
        str(shared_python),
        "-c",
        "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        external=True,
        silent=True,
    )
    own_site = session.run(
        "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])", silent=True
    )
    assert isinstance(shared_site, str) and isinstance(own_site, str)
    Path(own_site.strip(), "_shared_torch.pth").write_text(shared_site.strip() + "\n")
    session.run("python", "-c", "import torch; assert torch.__version__.startswith('2.13.0')")


def _install_packages(session: nox.Session, folders: list[Path], *, extras: str = "") -> None:
    if _needs_torch(folders):
        # The pinned CPU wheel first, so no package's range can pull a multi-GB CUDA build.
        _install_torch(session)
    suffix = f"[{extras}]" if extras else ""
    session.install(
        *(f"{folder}{suffix}" if folder == folders[-1] else str(folder) for folder in folders)
    )


_PACKAGE_NAMES = list(_packages())


@nox.session(tags=["ci", "tests"])
@nox.parametrize("package", _PACKAGE_NAMES, ids=_PACKAGE_NAMES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in a venv holding only what that package declares."""
    folders = _sibling_closure(package)
    _install_packages(session, folders, extras="test")
    tests_dir = _packages()[package] / "tests"
    session.run(
        "pytest",
        str(tests_dir),
        "-m",
        "not slow",
        "-p",
        "no:cacheprovider",
        "--timeout=900",
        *session.posargs,
    )


@nox.session(tags=["ci"])
def integration(session: nox.Session) -> None:
    """Cross-package tests (root tests/) with every package installed."""
    _install_torch(session)
    session.install(*(str(p) + "[test]" for p in _packages().values()))
    session.run(
        "pytest",
        "tests",
        "-m",
        "not slow",
        "--ignore-glob=tests/test_hf_*.py",  # the `hf` session's (they need transformers)
        "-p",
        "no:cacheprovider",
        "--timeout=900",
        *session.posargs,
    )


HF_REQUIREMENTS = ROOT / "examples" / "requirements-hf.txt"


def _install_hf(session: nox.Session) -> None:
    """Every package, then the examples' optional Hugging Face extra (transformers, safetensors)
    next to the shared torch; fails if the extra pulled another torch."""
    _install_torch(session)
    session.install(*(str(p) + "[test]" for p in _packages().values()))
    session.install("-r", str(HF_REQUIREMENTS), "matplotlib>=3.8")
    session.run(
        "python",
        "-c",
        "import torch, transformers, safetensors; assert torch.__version__.startswith('2.13.0'), "
        "torch.__version__; assert '_shared_torch' in torch.__file__, torch.__file__",
    )
    session.env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})  # no downloads


@nox.session(tags=["ci"])
def hf(session: nox.Session) -> None:
    """Hugging Face models (LLaMA tied, Qwen3-MoE, GPT-OSS) on fully_shard: FSDP2 and
    one-process parity, ties, checkpoint resume at other world sizes, export, compile."""
    _install_hf(session)
    session.run(
        "pytest",
        *sorted(str(p) for p in (ROOT / "tests").glob("test_hf_*.py")),
        "-m",
        "not slow",
        "-p",
        "no:cacheprovider",
        "--timeout=900",
        *session.posargs,
    )


@nox.session
def hf_slow(session: nox.Session) -> None:
    """The slow Hugging Face tests: inductor compiles of every decoder layer (not in CI)."""
    _install_hf(session)
    session.run(
        "pytest",
        *sorted(str(p) for p in (ROOT / "tests").glob("test_hf_*.py")),
        "-m",
        "slow",
        "-p",
        "no:cacheprovider",
        "--timeout=1800",
        *session.posargs,
    )


@nox.session(tags=["ci"])
def architecture(session: nox.Session) -> None:
    """The dependency table of DEVELOPERS.md, checked on the source (no install needed)."""
    session.install("pytest")
    session.run("pytest", "tests/test_architecture.py", "-p", "no:cacheprovider", *session.posargs)


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src/ and the cross-package typing checks."""
    _install_torch(session)
    session.install("mypy==2.4.1", *(f"-e{p}[test]" for p in _packages().values()))
    # by module name: mypy resolves the installed (editable) packages, never a source file twice
    modules = [arg for p in _packages() for arg in ("-p", p.replace("-", "_"))]
    session.run("mypy", "--strict", *modules, *session.posargs)
    session.run("mypy", "--strict", "tests/typing", *session.posargs)


@nox.session
def fuzz(session: nox.Session) -> None:
    """Hypothesis at 10,000 examples over the planner and ragged redistributions (not in CI)."""
    _install_torch(session)
    session.install(*(str(p) + "[test]" for p in _packages().values()))
    session.env["FUZZ_EXAMPLES"] = "10000"
    session.run(
        "pytest",
        "-m",
        "fuzz or not fuzz",
        "-k",
        "property",
        "packages",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a short sharded run on 2 gloo processes on this CPU."""
    _install_torch(session)
    session.install("matplotlib>=3.8", *(str(p) for p in _packages().values()))
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks against the peers, in one run each (figures, not pass/fail)."""
    _install_torch(session)
    packages = _packages()
    session.install(
        *(f"{p}[bench]" if name == "optim-blockwise" else str(p) for name, p in packages.items())
    )
    # DeepSpeed ZeRO-3 is a peer when it installs here (CPU, DS_ACCELERATOR=cpu); optional
    session.run("python", "-m", "pip", "install", "--quiet", "deepspeed", success_codes=[0, 1])
    session.env["DS_ACCELERATOR"] = "cpu"
    scripts = sorted(PACKAGES.glob("*/benchmarks/bench_*.py")) + sorted(
        (ROOT / "benchmarks").glob("bench_*.py")
    )
    for script in scripts:
        session.run("python", str(script), "--out", str(ROOT / "results"), *session.posargs)
