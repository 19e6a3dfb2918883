"""``benchmarks/gpu_check.sh --dry``: the GPU check's every part on CPU/gloo, tiny, so the script
cannot rot between the runs on a GPU machine (parity, race, the stress race check against the
one-process reference on 2 gloo ranks under torchrun and against the serial run on the fake
process group, the side-by-side benchmark in all three process-group settings, the host
benchmark, the report and its verdict, the README section rendered from it); and the pieces
whose failure the dry run cannot show (a mismatch, a vacuous sleep hook, a spent budget, a hung
launch) each made to happen."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
GPU_CHECK = BENCH / "gpu_check.py"


def _module(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={**os.environ, "PYTHON": sys.executable},
    )


def _json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def test_gpu_check_dry_run_passes(tmp_path: Path) -> None:
    """Every part, under a minute on 2 loaded cores: one process for the one-process runs (the
    host benchmark too), beside it one torchrun launch of 2 gloo ranks, then the report."""
    proc = _script("--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "result: passed" in summary
    assert "- not run (no CUDA in --dry)" in summary  # the sanitizer step is CUDA only
    launches = (tmp_path / "launches.tsv").read_text().splitlines()
    assert sorted(line.split("\t")[:2] for line in launches) == [
        ["runs_ranks", "0"],
        ["runs_single", "0"],
    ]
    for case in ("fp32", "bf16"):
        ours = _json(tmp_path / f"parity_ours_{case}.json")
        theirs = _json(tmp_path / f"parity_fsdp2_{case}.json")
        assert ours["losses"] == theirs["losses"] and len(ours["losses"]) == 3
    races = [_json(p) for p in sorted(tmp_path.glob("race_*.json"))]
    assert len(races) == 3
    # the race runs take every collective path: rank 0 of 4 on the fake process group
    assert all(r["world"] == 4 and r["losses"] == races[0]["losses"] for r in races)

    for case in ("fp32", "bf16"):
        # 2 real gloo ranks under torchrun, against the one-process reference: the same
        # arithmetic, so bitwise
        ranks = _json(tmp_path / f"stress_ranks2_{case}.json")
        assert (ranks["backend"], ranks["world"]) == ("gloo", 2)
        assert ranks["compare"]["verdict"] == "bitwise", ranks["compare"]
        assert ranks["compare"]["expected"] == "bitwise"
        # the hook ran once per collective: 3 groups (2 blocks + root), 4 steps: 3 forward +
        # 2 backward all-gathers and 3 reduce-scatters a step; no stream on CPU (stand-in)
        assert ranks["hook"]["calls"] == {"all_gather": 20, "reduce_scatter": 12}
        assert ranks["hook"]["without_stream"] == 32 and ranks["hook"]["host_s"] > 0
        fake = _json(tmp_path / f"stress_fake4_{case}.json")
        serial = _json(tmp_path / f"stress_fake4_{case}_serial.json")
        assert (fake["backend"], fake["world"], serial["serial"]) == ("fake", 4, True)
        assert fake["losses"] == serial["losses"] and serial["hook"] is None
        assert fake["params_sha256"] == serial["params_sha256"]
        assert fake["alloc_conf"] == "expandable_segments:True"
        assert serial["launch_blocking"] == "1"

    # HSDP, user collectives and in-place gradients: on 2 ranks a 2 x 1 mesh (the replicas'
    # all-reduce only); rank 0 of 4 on the fake group a 2 x 2 mesh (every collective stream)
    hsdp = _json(tmp_path / "stress_ranks2_hsdp_bf16.json")
    assert hsdp["variant"]["mesh"] == [2, 1] and hsdp["variant"]["custom_collectives"]
    assert hsdp["compare"]["verdict"] == "bitwise" and hsdp["hook"]["calls"]["all_reduce"] > 0
    fake_hsdp = _json(tmp_path / "stress_fake4_hsdp_bf16.json")
    assert fake_hsdp["variant"] == {
        "mesh": [2, 2],
        "hsdp": True,
        "custom_collectives": True,
        "inplace_grads": True,
        "float8": False,
    }
    assert set(fake_hsdp["hook"]["calls"]) == {"all_gather", "reduce_scatter", "all_reduce"}
    # float8: the FP8 quantized all-gather on 2 ranks against a reference that quantizes the
    # whole weights (the same arithmetic: bitwise)
    fp8 = _json(tmp_path / "stress_ranks2_float8_bf16.json")
    assert fp8["variant"]["float8"] and fp8["compare"]["verdict"] == "bitwise", fp8["compare"]
    serial_hsdp = _json(tmp_path / "stress_fake4_hsdp_bf16_serial.json")
    assert fake_hsdp["losses"] == serial_hsdp["losses"]

    report = _json(tmp_path / "gpu_check.json")
    assert report["dry"] is True and report["result"] == "passed"
    rows = {row["config"]: row for row in report["bench"]["rows"]}
    assert set(rows) == {
        "ranks2-avoid-unset",
        "ranks2-avoid-1",
        "ranks2-hsdp",
        "world1-avoid-unset",
        "fake8",
    }
    assert rows["ranks2-hsdp"]["mesh"] == [2, 1]  # the HSDP case: 2 replicas x 1 shard
    assert [(r["backend"], r["world"]) for r in report["bench"]["rows"]] == [
        ("gloo", 2),
        ("gloo", 2),
        ("gloo", 2),
        ("gloo", 1),
        ("fake", 8),
    ]
    for row in rows.values():
        assert row["runs"] == [2, 2] and row["finite"] and row["step_ratio"] > 0
        # our losses against FSDP2's in the same command: asserted, a slot for every config
        fake = row["backend"] == "fake"  # its collectives move no data: nothing to compare
        assert (
            row["loss_verdict"] == "not comparable"
            if fake
            else row["loss_verdict"]
            in (
                "bitwise",
                "within tolerance",
            )
        ), row
    summary_text = (tmp_path / "summary.md").read_text()
    for config in rows:
        assert f"- losses ours vs FSDP2, {config} (" in summary_text
    runs = [_json(p) for p in tmp_path.glob("bench_ranks2-avoid-1_*.json")]
    assert {r["avoid_record_streams"] for r in runs} == {"1"}
    assert {(r["engine"], r["index"]) for r in runs} == {
        (e, i) for e in ("ours", "fsdp2") for i in (1, 2)
    }
    assert "| 2 x gloo | bf16 mixed | 1 | 2, 2 |" in (tmp_path / "gpu_bench.md").read_text()
    host = _json(tmp_path / "scale_host.json")
    assert {r["world"] for r in host["rows"]} == {8, 64}
    assert {r["engine"] for r in host["rows"]} == {"ours", "fsdp2"}

    # the README section renders from this JSON, labelled; a dry JSON never reaches the README
    tables = _module("readme_tables")
    section = tables.gpu_section(report)
    assert section.startswith("DRY RUN on CPU (not GPU figures).")
    assert "stress race check, fp32, 2 ranks (gloo): bitwise" in section
    (tmp_path / "gpu_check").mkdir()
    (tmp_path / "gpu_check" / "gpu_check.json").write_text(json.dumps(report))
    readme = "<!-- generated: gpu_check (benchmarks/readme_tables.py) -->\n"
    readme += "<!-- end generated: gpu_check -->\n"
    with pytest.raises(SystemExit, match="a --dry run's"):
        tables.render(readme, tmp_path, ["gpu_check"])
    assert "**Not run yet**" in tables.render(readme, tmp_path / "none", ["gpu_check"])


def _report(out: Path, parts: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), "report", "--out", str(out), "--parts", parts],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_gpu_check_report_fails_on_a_difference(tmp_path: Path) -> None:
    """The report's verdict is real: a loss that differs in its last bit fails it."""
    run = {"steps": 1, "launch_blocking": "0", "losses": [(1.0).hex()], "params_sha256": "x"}
    for engine in ("ours", "fsdp2"):
        for case in ("fp32", "bf16"):
            (tmp_path / f"parity_{engine}_{case}.json").write_text(json.dumps(run))
    for name in ("a", "b", "c"):
        (tmp_path / f"race_{name}.json").write_text(json.dumps(run))
    (tmp_path / "sanitizer.txt").write_text("FAILED (see sanitizer.log)\n")
    (tmp_path / "sanitizer.log").write_text("CUDASanitizerErrors: a data race\n")
    other = dict(run, losses=[(1.0 + 2**-52).hex()])
    (tmp_path / "race_b.json").write_text(json.dumps(other))
    proc = _report(tmp_path, "parity,race,sanitizer")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "result: FAILED: race race_b, sanitizer" in proc.stdout
    assert "CUDASanitizerErrors: a data race" in proc.stdout


def _stress(backend: str, case: str, **extra: Any) -> dict[str, Any]:
    calls = {"all_gather": 5, "reduce_scatter": 3}
    return {
        "kind": "stress",
        "case": case,
        "backend": backend,
        "world": 4,
        "device": "cuda",
        "serial": False,
        "steps": 1,
        "model": {"layers": 1, "dim": 1, "hidden": 1},
        "batch_per_rank": 1,
        "hook": {"calls": calls, "without_stream": 0, "not_current": 0, "cycles": 9},
        "losses": [(1.0).hex()],
        "params_sha256": "x",
        **extra,
    }


def test_gpu_check_report_fails_on_a_stress_mismatch_or_a_vacuous_hook(tmp_path: Path) -> None:
    """A mismatch with the reference, a run whose hook saw no reduce-scatter (the sleeps would
    prove nothing), calls off the collective's stream, a fake-group run that differs from its
    serial run, and a launch that failed: each fails the report, by name."""
    bad = {"verdict": "MISMATCH", "expected": "within tolerance", "loss_max_rel_diff": 0.5}
    (tmp_path / "stress_ranks4_fp32.json").write_text(
        json.dumps(_stress("nccl", "fp32", compare=bad))
    )
    vacuous = _stress("nccl", "bf16", compare={"verdict": "bitwise", "expected": "bitwise"})
    vacuous["hook"] = {"calls": {"all_gather": 4}, "without_stream": 2, "not_current": 1}
    (tmp_path / "stress_ranks4_bf16.json").write_text(json.dumps(vacuous))
    (tmp_path / "stress_fake4_fp32.json").write_text(json.dumps(_stress("fake", "fp32")))
    serial = _stress("fake", "fp32", losses=[(2.0).hex()], serial=True, hook=None)
    (tmp_path / "stress_fake4_fp32_serial.json").write_text(json.dumps(serial))
    (tmp_path / "launches.tsv").write_text("stress_x\t124\t60\t60\nbench_y\tskipped\t0\t180\n")
    proc = _report(tmp_path, "stress")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    verdict = proc.stdout.split("result: ")[1]
    for failure in (
        "stress stress_ranks4_fp32,",
        "stress stress_ranks4_bf16 hook",
        "stress stress_fake4_fp32,",
        "launch stress_x (timed out after 60 s)",
        "launch bench_y (skipped: the time budget was spent)",
    ):
        assert failure in verdict, verdict
    assert "no reduce_scatter collective seen by the hook" in proc.stdout
    assert "2 hook calls without a stream" in proc.stdout
    assert "1 hook calls off the collective's stream" in proc.stdout


def test_judge_bitwise_tolerance_and_mismatch() -> None:
    """The stress verdict against the one-process reference: bitwise, within the stated
    tolerance (a reassociated sum's rounding), a mismatch (a shard off by an update, or NaN)."""
    runs = _module("gpu_check_runs")
    gen = torch.Generator().manual_seed(0)
    initial = {"w": torch.randn(64, 64, generator=gen)}
    ref = {"w": initial["w"] - 1e-3 * torch.randn(64, 64, generator=gen).sign()}
    losses = torch.rand(2, 5, generator=gen) + 0.5

    def judge(ours: dict[str, torch.Tensor], ours_losses: torch.Tensor, world: int = 2) -> Any:
        return runs.judge(ours_losses, ours, losses, ref, initial, case="fp32", world=world)

    same = judge({"w": ref["w"].clone()}, losses.clone())
    assert same["verdict"] == "bitwise" and same["expected"] == "bitwise"
    rounding = {"w": ref["w"] * (1 + 2**-23)}  # one ulp
    near = judge(rounding, losses * (1 + 2**-23), world=4)
    assert near["verdict"] == "within tolerance" and near["expected"] == "within tolerance"
    assert near["first_differing_step"] == 0
    stale = {"w": ref["w"].clone()}
    stale["w"][:32] = initial["w"][:32]  # half the tensor missed every update: a stale shard
    assert judge(stale, losses.clone(), world=4)["verdict"] == "MISMATCH"
    nan = {"w": ref["w"].clone()}
    nan["w"][0, 0] = float("nan")
    result = judge(nan, losses.clone())
    assert result["verdict"] == "MISMATCH" and not result["finite"]
    assert judge({}, losses.clone())["verdict"] == "MISMATCH"  # a parameter lost


def test_a_spent_budget_skips_and_fails_loudly(tmp_path: Path) -> None:
    """``--budget``: launches that would start after it are skipped and reported, so the
    command ends in time and says what it did not do."""
    proc = _script("--out", str(tmp_path), "--only", "parity", "--budget", "5", timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "runs_single: skipped" in proc.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert "launch runs_single (skipped: the time budget was spent)" in summary
    assert "parity fp32 missing" in summary


def test_a_launch_stops_itself_before_its_time_limit(tmp_path: Path) -> None:
    """``GPU_CHECK_DEADLINE_S`` (what the script sets per launch): the process dumps every
    thread's stack and exits 10 s before it (after 5 s at least), whatever it is doing: here a
    run whose sleep hook sleeps up to 60 s before each collective."""
    sizes = ["--dim", "8", "--hidden", "8", "--layers", "1", "--batch", "2", "--steps", "50"]
    sleeps = ["--host-sleep", "60", "--out", str(tmp_path / "s.json")]
    start = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(GPU_CHECK),
            "stress",
            "--device",
            "cpu",
            "--fake-world",
            "4",
            *sizes,
            *sleeps,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "GPU_CHECK_DEADLINE_S": "12"},
    )
    assert proc.returncode != 0 and not (tmp_path / "s.json").exists()
    assert "Timeout (0:00:05)!" in proc.stderr, proc.stderr[-2000:]  # and the stacks after it
    assert time.monotonic() - start < 60


def test_no_option_is_taken_by_torchrun() -> None:
    """torchrun parses the options after the script too: one that is a prefix of several of
    torchrun's (``--run``: ``--run-path``, ``--run_path``) stops the launch. None of ours is a
    prefix of any of torchrun's."""
    from torch.distributed.run import get_args_parser

    theirs = {o for action in get_args_parser()._actions for o in action.option_strings}
    parser = _module("gpu_check")._parser()
    sub = next(a for a in parser._actions if a.dest == "cmd")
    ours = {
        o
        for name, p in sub.choices.items()  # type: ignore[attr-defined]
        if name in {"bench", "stress", "many"}
        for action in p._actions
        for o in action.option_strings
        if o.startswith("--") and o != "--help"
    }
    assert ours and not {o for o in ours for t in theirs if t.startswith(o)}


def test_torch_shims_alias_the_newer_collective_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without ``all_gather_single`` / ``reduce_scatter_single`` (before 2.13: a GPU
    machine's own torch), the check aliases them to the older names for its processes."""
    shims = _module("gpu_check").torch_shims
    assert shims() == []  # torch 2.13 has both
    monkeypatch.delattr(dist, "all_gather_single")
    monkeypatch.delattr(dist, "reduce_scatter_single")
    assert shims() == [
        "torch.distributed.all_gather_single = all_gather_into_tensor",
        "torch.distributed.reduce_scatter_single = reduce_scatter_tensor",
    ]
    assert dist.all_gather_single is dist.all_gather_into_tensor  # type: ignore[attr-defined]


@pytest.mark.slow  # ~5 minutes: each run its own launch (torchrun for the ranks), as on GPUs
def test_gpu_check_dry_separate_launches(tmp_path: Path) -> None:
    proc = _script("--separate", "--runs", "1", "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = [line.split("\t")[0] for line in (tmp_path / "launches.tsv").read_text().splitlines()]
    assert names[0] == "preflight" and "stress_ranks2_bf16" in names and names[-1] == "host"
    bench = [n for n in names if n.startswith("bench_ranks2-avoid-unset")]
    assert bench == ["bench_ranks2-avoid-unset_ours_1", "bench_ranks2-avoid-unset_fsdp2_1"]
    assert "result: passed" in (tmp_path / "summary.md").read_text()


def _bench(engine: str, index: int, losses: list[float], **extra: Any) -> dict[str, Any]:
    model = {"dim": 1, "layers": 1, "heads": 1, "ffn": 1, "vocab": 1, "seq": 1}
    return {
        "kind": "bench",
        "config": "ranks8-avoid-unset",
        "engine": engine,
        "index": index,
        "model": dict(model, batch_per_rank=1, parameters=1e6),
        "world": 8,
        "backend": "nccl",
        "mixed": True,
        "avoid_record_streams": None,
        "median_ms": 10.0 if engine == "fsdp2" else 5.0,
        "min_ms": 9.0 if engine == "fsdp2" else 4.0,
        "losses": losses,
        "memory": {"max_allocated": 2**30, "max_reserved": 2**31, "alloc_retries": 0},
        **extra,
    }


@pytest.mark.parametrize(
    ("ours", "verdict", "fails"),
    [
        ([2.0, 1.5], "bitwise", False),
        ([2.0, 1.5 * (1 + 1e-3)], "within tolerance", False),  # bf16's LOSS_RTOL is 2e-2
        ([2.0, 1.2], "MISMATCH", True),  # a fast wrong run
    ],
)
def test_gpu_check_report_asserts_our_losses_against_fsdp2(
    tmp_path: Path, ours: list[float], verdict: str, fails: bool
) -> None:
    """The bench's step-time ratio never passes on its own: our losses are compared with
    FSDP2's of the same command, and a mismatch fails the report by name."""
    for index in (1, 2):
        (tmp_path / f"bench_x_fsdp2_{index}.json").write_text(
            json.dumps(_bench("fsdp2", index, [2.0, 1.5]))
        )
        (tmp_path / f"bench_x_ours_{index}.json").write_text(
            json.dumps(_bench("ours", index, ours))
        )
    proc = _report(tmp_path, "bench")
    assert f"- losses ours vs FSDP2, ranks8-avoid-unset (8 x nccl): {verdict}" in proc.stdout
    if fails:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "bench ranks8-avoid-unset: losses ours vs FSDP2 MISMATCH" in proc.stdout
    else:
        assert "losses ours vs FSDP2 MISMATCH" not in proc.stdout
        assert "one device: no step-time ratio" not in proc.stdout  # 8 real ranks
