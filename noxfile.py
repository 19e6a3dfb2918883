"""The one task runner of the monorepo.

`nox -t ci` is what CI runs, in this order and stopping at the first failure: lint, typecheck,
architecture (fast, so a mistake there fails in a minute), then every package's tests in its own
venv, cross-package integration, and the newcomer path (`nox -s dev` + a 2-step torchrun demo).
`nox -s demo` is the main job; `nox -s dev` builds `.venv` for running the examples and torchrun;
`nox -s numerics` runs the floating-point tests under every CPU kernel set x thread count;
`nox -s fuzz` the property tests at 10,000 random examples; `nox -s bench` the benchmarks;
`nox -s trainers` accelerate, Lightning, transformers' Trainer, torchtitan on fsdp_engine;
`nox -s finetune` QLoRA (torchao NF4 + LoRA) and PEFT LoRA (accelerate, Trainer) against FSDP2.

Each package's test session installs only what that package declares (its sibling dependencies come
from this checkout), so an undeclared import fails there instead of passing by accident.
"""

from __future__ import annotations

import os
import sys
import tomllib
from pathlib import Path

import nox

ROOT = Path(__file__).parent
PACKAGES = ROOT / "packages"
TORCH = "torch==2.13.0"

nox.options.default_venv_backend = "virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.stop_on_first_error = True  # CI fails fast: the cheap checks run first

# hypothesis: the same examples on every CI run (derandomized; see conftest.py)
CI_ENV = {"HYPOTHESIS_PROFILE": "ci"}
# Tests run in parallel worker processes (pytest-xdist): the threaded-process-group tests hold
# the GIL of one process, the gloo tests spend seconds starting processes, so two workers use a
# 2-core machine about twice as well. At most 4, so a many-core CI does not start dozens of
# torch imports; each test still runs alone in its worker, under its own hard timeout.
# ``--durations`` in the CI sessions: where the time goes is in every CI log.
XDIST = "pytest-xdist==3.8.0"


def _pytest_parallel() -> list[str]:
    # whole files per worker: a module-scoped fixture (one launch of several runs) runs once
    workers = str(max(1, min(4, os.cpu_count() or 1)))
    return ["-n", workers, "--dist", "loadfile", "--durations=15"]


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


# [Note: builds without isolation]
# pip builds each local package in a fresh isolated environment by default, installing its
# build backend there first: ~2 s per package per session, a minute or more over the CI sessions.
# The backends (hatchling, and ``editables`` for its editable builds, for the five packages;
# setuptools for ``examples``) are installed once into the session's venv and the local builds
# use them there; what gets built is the same.
BUILD_BACKENDS = ("hatchling>=1.25", "editables>=0.5", "setuptools>=68")


def _install_local(session: nox.Session, *args: str) -> None:
    """``session.install`` of local package folders (and anything else), built without
    isolation ([Note: builds without isolation])."""
    session.install(*BUILD_BACKENDS)
    session.install("--no-build-isolation", *args)


def _install_packages(session: nox.Session, folders: list[Path], *, extras: str = "") -> None:
    if _needs_torch(folders):
        # The pinned CPU wheel first, so no package's range can pull a multi-GB CUDA build.
        _install_torch(session)
    suffix = f"[{extras}]" if extras else ""
    _install_local(
        session,
        *(f"{folder}{suffix}" if folder == folders[-1] else str(folder) for folder in folders),
    )


_PACKAGE_NAMES = list(_packages())


@nox.session(tags=["ci"])
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6")
    session.run("ruff", "check", ".", *session.posargs)
    session.run("ruff", "format", "--check", ".")


@nox.session(tags=["ci"])
def typecheck(session: nox.Session) -> None:
    """mypy --strict over every package's src/ and the cross-package typing checks."""
    _install_torch(session)
    _install_local(session, "mypy==2.4.1", *(f"-e{p}[test]" for p in _packages().values()))
    # by module name: mypy resolves the installed (editable) packages, never a source file twice
    modules = [arg for p in _packages() for arg in ("-p", p.replace("-", "_"))]
    session.run("mypy", "--strict", *modules, *session.posargs)
    session.run("mypy", "--strict", "tests/typing", *session.posargs)


@nox.session(tags=["ci"])
def architecture(session: nox.Session) -> None:
    """The dependency table of DEVELOPERS.md, checked on the source (no install needed)."""
    session.install("pytest")
    session.run("pytest", "tests/test_architecture.py", "-p", "no:cacheprovider", *session.posargs)


@nox.session(tags=["ci", "tests"])
@nox.parametrize("package", _PACKAGE_NAMES, ids=_PACKAGE_NAMES)
def tests(session: nox.Session, package: str) -> None:
    """One package's tests, in a venv holding only what that package declares."""
    folders = _sibling_closure(package)
    _install_packages(session, folders, extras="test")
    session.install(XDIST)
    tests_dir = _packages()[package] / "tests"
    session.run(
        "pytest",
        *_pytest_parallel(),
        str(tests_dir),
        "-m",
        "not slow",
        "-p",
        "no:cacheprovider",
        "--timeout=900",
        *session.posargs,
        env=CI_ENV,
    )


@nox.session(tags=["ci"])
def integration(session: nox.Session) -> None:
    """Cross-package tests (root tests/) with every package installed."""
    _install_torch(session)
    _install_local(session, *(str(p) + "[test]" for p in _packages().values()), XDIST)
    session.run(
        "pytest",
        *_pytest_parallel(),
        "tests",
        "-m",
        "not slow",
        "--ignore-glob=tests/test_hf_*.py",  # the `hf` session's (they need transformers)
        "--ignore-glob=tests/test_trainers_*.py",  # the `trainers` session's
        "--ignore-glob=tests/test_float8_*.py",  # the `float8` session's (they need torchao)
        "--ignore-glob=tests/test_finetune_*.py",  # the `finetune` session's (torchao, ...)
        "-p",
        "no:cacheprovider",
        "--timeout=900",
        *session.posargs,
        env=CI_ENV,
    )


@nox.session
def slow(session: nox.Session) -> None:
    """The tests marked ``slow`` (not in CI: over the CI budget on 2 cores), every package and
    the root tests; the Hugging Face ones are ``nox -s hf_slow``."""
    _install_torch(session)
    _install_local(session, *(str(p) + "[test]" for p in _packages().values()), XDIST)
    paths = [str(p / "tests") for p in _packages().values()] + ["tests"]
    session.run(
        "pytest",
        *_pytest_parallel(),
        *paths,
        "-m",
        "slow",
        "--ignore-glob=tests/test_hf_*.py",
        "--ignore-glob=tests/test_trainers_*.py",
        "--ignore-glob=tests/test_float8_*.py",
        "--ignore-glob=tests/test_finetune_*.py",
        "-p",
        "no:cacheprovider",
        "--timeout=1800",
        *session.posargs,
        env=CI_ENV,
    )


def _build_dev_venv(session: nox.Session) -> Path:
    """``.venv``: the pinned torch, the five packages editable (with their test extras) and the
    examples' extras; idempotent."""
    venv = ROOT / ".venv"
    python = venv / "bin" / "python"
    if not python.exists():
        session.run(sys.executable, "-m", "venv", str(venv), external=True)
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    session.run(*pip, "--upgrade", "pip", external=True)  # venv's bundled pip 23 cannot resolve
    session.run(*pip, TORCH, external=True)  # first: no package's range may pull another torch
    editable = [f"-e{folder}[test]" for folder in _packages().values()]
    session.run(*pip, *BUILD_BACKENDS, external=True)  # [Note: builds without isolation]
    session.run(
        *pip, "--no-build-isolation", *editable, f"-e{ROOT / 'examples'}[demo]", external=True
    )
    return venv


@nox.session(venv_backend="none")
def dev(session: nox.Session) -> None:
    """Build ``.venv`` for running the examples, torchrun and pytest by hand."""
    venv = _build_dev_venv(session)
    session.log(
        f"ready: source {venv.relative_to(ROOT)}/bin/activate, then e.g.\n"
        "    torchrun --nproc-per-node 2 examples/demo.py\n"
        "    python examples/demo.py --world-size 4 --optimizer muon\n"
        "    pytest packages/fsdp-engine/tests -x"
    )


@nox.session(venv_backend="none", tags=["ci"])
def newcomer(session: nox.Session) -> None:
    """The README's path after its two commands, as a new user takes it: ``nox -s dev``, then
    the demo under torchrun and self-spawned (2 steps each); the checkout stays clean."""
    venv = _build_dev_venv(session)
    python, torchrun = str(venv / "bin" / "python"), str(venv / "bin" / "torchrun")
    before = _git_status(session)
    summary = ROOT / "runs" / "demo" / "demo_summary.json"
    demo = ["examples/demo.py", "--steps", "2", "--eval-every", "1", "--sample", "4"]
    for launch in (
        [torchrun, "--nproc-per-node", "2", *demo],
        [python, *demo, "--world-size", "2"],
    ):
        summary.unlink(missing_ok=True)
        session.run(*launch, external=True)
        if not summary.is_file():
            session.error(f"{' '.join(launch)} wrote no {summary.relative_to(ROOT)}")
    session.run(
        python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "examples/tests", external=True
    )
    after = _git_status(session)
    if after != before:
        session.error(f"the demo changed the checkout: {sorted(set(after) - set(before))}")


def _git_status(session: nox.Session) -> list[str]:
    out = session.run("git", "status", "--porcelain", external=True, silent=True)
    return sorted(str(out or "").splitlines())


HF_ENV = {**CI_ENV, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing downloaded


def _install_hf(session: nox.Session) -> None:
    """Every package and the examples' optional ``hf`` extra (the pinned transformers and
    safetensors) next to the shared torch; fails if the extra brought another torch."""
    _install_torch(session)
    _install_local(
        session,
        *(str(p) + "[test]" for p in _packages().values()),
        f"{ROOT / 'examples'}[hf,demo]",
        XDIST,
    )
    session.run(
        "python",
        "-c",
        "import torch, transformers, safetensors; assert torch.__version__.startswith('2.13.0')"
        " and '_shared_torch' in torch.__file__, torch.__file__",
    )
    session.run("python", "-m", "pip", "check")


def _hf_pytest(session: nox.Session, marker: str, timeout: int) -> None:
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_hf_*.py"))
    session.run(
        "pytest",
        *_pytest_parallel(),
        *tests,
        "-m",
        marker,
        "-p",
        "no:cacheprovider",
        f"--timeout={timeout}",
        *session.posargs,
        env=HF_ENV,
    )


@nox.session(tags=["ci"])
def hf(session: nox.Session) -> None:
    """Hugging Face models (LLaMA with tied embeddings, Qwen3-MoE, GPT-OSS) on fully_shard at
    world size 2: FSDP2 and one-process parity, ties, gradient checkpointing, checkpoint resume
    at world sizes 1 and 4, export to save_pretrained, compiled layers (`examples[hf]`)."""
    _install_hf(session)
    _hf_pytest(session, "not slow", 900)


@nox.session
def hf_slow(session: nox.Session) -> None:
    """The slow Hugging Face tests (not in CI): inductor-compiled layers of every model, the
    graph breaks of the MoE models' layers, gradient checkpointing, the resume at world sizes 1
    and 4 and the training script with both engines side by side."""
    _install_hf(session)
    _hf_pytest(session, "slow", 1800)


@nox.session
def float8(session: nox.Session) -> None:
    """torchao's float8 training with ``enable_fsdp_float8_all_gather=True`` on fsdp_engine
    against torch's FSDP2, loss for loss (GEMMs emulated on the CPU; `examples[float8]` pins
    torchao). Not in CI: torchao's install and the float8 emulation cost minutes."""
    _install_torch(session)
    _install_local(
        session,
        *(str(p) + "[test]" for p in _packages().values()),
        f"{ROOT / 'examples'}[float8]",
        XDIST,
    )
    session.run(
        "python",
        "-c",
        "import torch, torchao; assert torch.__version__.startswith('2.13.0')"
        " and '_shared_torch' in torch.__file__, torch.__file__",
    )
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_float8_*.py"))
    session.run(
        "pytest",
        *_pytest_parallel(),
        *tests,
        "-p",
        "no:cacheprovider",
        "--timeout=1800",
        *session.posargs,
        env=CI_ENV,
    )


FINETUNE_EXTRAS = ["finetune", "hf"]  # examples' extras the `finetune` session installs


@nox.session
def finetune(session: nox.Session) -> None:
    """Fine-tuning as people run it, on fsdp_engine against torch's FSDP2 (`examples[finetune]`
    pins the packages; tests/test_finetune_*.py, helpers in tests/finetune_workers.py): QLoRA
    with torchao's NF4 base weights and LoRA adapters, loss for loss, collective bytes per
    step, checkpoints across world sizes. Not in CI: the NF4 mechanism (subclasses with a
    storage of their own) is covered there by fsdp-engine's TwoTensor tests; this session
    adds torchao (a 3.4 MB wheel, ~5 s to install, but ~13 s to import on the 2-core machine).
    LoRA with PEFT on a small transformers LLaMA through accelerate's FSDP2 plugin and
    transformers' Trainer, switched to fsdp_engine, loss for loss and the saved adapter
    (tests/test_finetune_lora.py, helpers in tests/lora_workers.py). Measured on the 2-core
    machine at load 20-30: test_finetune_lora.py 170 s (14 tests, one 2-process launch for the
    10 runs plus the example under torchrun), test_finetune_qlora.py 44-53 s; with the
    transformers/accelerate/PEFT/torchao install, too much for the CI's 15 minutes."""
    _install_torch(session)
    extras = ",".join(FINETUNE_EXTRAS)
    _install_local(
        session,
        *(str(p) + "[test]" for p in _packages().values()),
        f"{ROOT / 'examples'}[{extras}]",
        XDIST,
    )
    session.run(
        "python",
        "-c",
        "import torch, torchao, peft, accelerate, transformers, safetensors;"
        " assert torch.__version__.startswith('2.13.0') and '_shared_torch' in torch.__file__,"
        " torch.__file__",
    )
    session.run("python", "-m", "pip", "check")
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_finetune_*.py"))
    if not tests:
        session.error("no tests/test_finetune_*.py")
    session.run(
        "pytest",
        *_pytest_parallel(),
        *tests,
        "-p",
        "no:cacheprovider",
        "--timeout=1800",
        *session.posargs,
        env=HF_ENV,
    )


@nox.session
def hf_demo(session: nox.Session) -> None:
    """``examples/hf_train.py`` on 2 gloo processes (posargs: its options)."""
    _install_hf(session)
    session.run("python", "examples/hf_train.py", *session.posargs, env=HF_ENV)


@nox.session
def trainers(session: nox.Session) -> None:
    """Trainers that import FSDP2 themselves, switched to fully_shard by
    ``fsdp_engine.use_as_torch_fsdp()`` (not in CI: the CI budget; installs
    ``examples[hf,trainers]``): accelerate's FSDP2 plugin, Lightning's ModelParallelStrategy,
    transformers' Trainer and torchtitan's FSDP helpers, each loss for loss against torch's FSDP2
    on 2 gloo processes (``tests/test_trainers_*.py``)."""
    _install_torch(session)
    _install_local(
        session,
        *(str(p) + "[test]" for p in _packages().values()),
        f"{ROOT / 'examples'}[hf,trainers]",
        XDIST,
    )
    session.run(
        "python",
        "-c",
        "import torch, accelerate, lightning, transformers, torchtitan;"
        " assert torch.__version__.startswith('2.13.0') and '_shared_torch' in torch.__file__,"
        " torch.__file__",
    )
    session.run("python", "-m", "pip", "check")
    tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_trainers_*.py"))
    if not tests:
        session.error("no tests/test_trainers_*.py")
    session.run(
        "pytest",
        *_pytest_parallel(),
        *tests,
        "-p",
        "no:cacheprovider",
        "--timeout=1800",
        *session.posargs,
        env=HF_ENV,
    )


@nox.session
def numerics(session: nox.Session) -> None:
    """The floating-point tests (marker ``numerics``) under every CPU kernel set this CPU has
    (ATEN_CPU_CAPABILITY default, avx2, avx512) x OMP_NUM_THREADS 1 and 2, as CI machines
    differ (not in CI: about 6x the tests' time)."""
    _install_torch(session)
    _install_local(session, *(str(p) + "[test]" for p in _packages().values()), XDIST)
    best = session.run(
        "python", "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())", silent=True
    )
    capabilities = ["default", "avx2"] + (["avx512"] if "AVX512" in str(best) else [])
    paths = [str(p / "tests") for p in _packages().values()] + ["tests"]
    for capability in capabilities:
        for threads in ("1", "2"):
            env = {**CI_ENV, "ATEN_CPU_CAPABILITY": capability, "OMP_NUM_THREADS": threads}
            session.log(f"ATEN_CPU_CAPABILITY={capability} OMP_NUM_THREADS={threads}")
            session.run(
                "python",
                "-c",
                "import torch; print('kernels:', torch.backends.cpu.get_cpu_capability())",
                env=env,
            )
            session.run(
                "pytest",
                *_pytest_parallel(),
                *paths,
                "-m",
                "numerics and not slow",
                "-p",
                "no:cacheprovider",
                "--timeout=900",
                "-q",
                *session.posargs,
                env=env,
            )


@nox.session
def fuzz(session: nox.Session) -> None:
    """Hypothesis at 10,000 examples over the planner and ragged redistributions (not in CI)."""
    _install_torch(session)
    _install_local(session, *(str(p) + "[test]" for p in _packages().values()))
    session.env["FUZZ_EXAMPLES"] = "10000"
    session.env["HYPOTHESIS_PROFILE"] = "fuzz"  # fresh random examples every run
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
    _install_local(session, *(str(p) for p in _packages().values()), f"{ROOT / 'examples'}[demo]")
    session.run("python", "examples/demo.py", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Side-by-side benchmarks against the peers, in one run each (figures, not pass/fail)."""
    _install_torch(session)
    packages = _packages()
    _install_local(
        session,
        *(f"{p}[bench]" if name == "optim-blockwise" else str(p) for name, p in packages.items()),
    )
    # DeepSpeed ZeRO-3 is a peer when it installs here (CPU, DS_ACCELERATOR=cpu); optional
    session.run("python", "-m", "pip", "install", "--quiet", "deepspeed", success_codes=[0, 1])
    session.env["DS_ACCELERATOR"] = "cpu"
    scripts = sorted(PACKAGES.glob("*/benchmarks/bench_*.py")) + sorted(
        (ROOT / "benchmarks").glob("bench_*.py")
    )
    for script in scripts:
        session.run("python", str(script), "--out", str(ROOT / "results"), *session.posargs)
    # the README's tables, written from the JSON the benchmarks just wrote (never by hand)
    session.run("python", str(ROOT / "benchmarks" / "readme_tables.py"))


@nox.session
def soak(session: nox.Session) -> None:
    """Not in CI (about an hour on 2 cores): 2,000 steps of the demo model at world size 4 under
    ``torchrun --max-restarts``, a checkpoint every 100 steps, a random rank SIGKILLed about
    every 500 steps; the final state must equal an uninterrupted run bit for bit and live memory
    stay flat (``benchmarks/soak.py``; figures in ``results/soak.md``)."""
    _install_torch(session)
    _install_local(session, *(str(p) for p in _packages().values()))
    session.run("python", "benchmarks/soak.py", "--out", str(ROOT / "results"), *session.posargs)
