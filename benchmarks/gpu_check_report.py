"""The report of ``gpu_check.sh``: verdicts and tables from the runs' JSON (no torch import).

Reads what the script's launches wrote into ``--out`` and writes ``summary.md`` (every verdict,
the tables, the failed launches' log tails), ``gpu_bench.md`` (the side-by-side table) and
``gpu_check.json`` (everything, for ``benchmarks/readme_tables.py``). Returns 1 when a selected
part failed or is missing (a launch that failed, timed out or was skipped for the time budget
counts), else 0.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_check_runs import LOSS_RTOL

PARTS = ("parity", "race", "stress", "bench", "sanitizer", "host")


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def _launches(out: Path) -> list[dict[str, Any]]:
    """``launches.tsv``: name, exit status (or ``skipped``), seconds, limit, one per launch."""
    path = out / "launches.tsv"
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            name, rc, seconds, limit = [*line.split("\t"), "", "", ""][:4]
            rows.append({"name": name, "rc": rc, "seconds": seconds, "limit": limit})
    return rows


class Report:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.lines: list[str] = []
        self.failures: list[str] = []
        self.data: dict[str, Any] = {}

    def fail(self, what: str) -> None:
        self.failures.append(what)

    def section(self, title: str) -> None:
        self.lines += ["", f"## {title}", ""]


def parity(r: Report) -> None:
    r.section("parity at world size 1 (bitwise: losses and final parameters)")
    verdicts = {}
    for case in ("fp32", "bf16"):
        ours, theirs = (_load(r.out / f"parity_{e}_{case}.json") for e in ("ours", "fsdp2"))
        if ours is None or theirs is None:
            r.lines.append(f"- {case}: missing")
            r.fail(f"parity {case} missing")
            continue
        same = (
            ours["losses"] == theirs["losses"] and ours["params_sha256"] == theirs["params_sha256"]
        )
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True))
                if a != b
            ),
            None,
        )
        r.lines.append(
            f"- {case}: {'equal' if same else 'DIFFERENT'} over {ours['steps']} steps"
            + ("" if first is None else f" (first differing loss at step {first})")
            + f"; last loss {float.fromhex(ours['losses'][-1]):.6g}"
        )
        verdicts[case] = "bitwise equal" if same else "DIFFERENT"
        if not same:
            r.fail(f"parity {case}")
    r.data["parity"] = verdicts
    r.section("memory at world size 1 (torch.cuda.memory_stats, one training run each)")
    mem = {}
    for engine in ("ours", "fsdp2"):
        run = _load(r.out / f"parity_{engine}_bf16.json")
        mem[engine] = run.get("memory") if run else None
    if mem["ours"] and mem["fsdp2"]:
        r.lines.append("| stat | ours MiB | FSDP2 MiB | ours / FSDP2 |")
        r.lines.append("|---|---|---|---|")
        for key, value in mem["ours"].items():
            other = mem["fsdp2"][key]
            ratio = f"{value / other:.2f}x" if other else "-"
            scale = 2**20 if "bytes" in key or key == "max_memory_reserved" else 1
            r.lines.append(f"| {key} | {value / scale:.1f} | {other / scale:.1f} | {ratio} |")
    else:
        r.lines.append("(no CUDA: no memory statistics in the dry run)")


def race(r: Report) -> None:
    r.section("stream race, rank 0 of 4 on the fake process group (bitwise identical run to run)")
    runs = sorted(r.out.glob("race_*.json"))
    reference = _load(runs[0]) if runs else None
    for path in runs:
        run = _load(path)
        assert run is not None and reference is not None
        same = run["losses"] == reference["losses"]
        same = same and run["params_sha256"] == reference["params_sha256"]
        finite = all(math.isfinite(float.fromhex(v)) for v in run["losses"])
        r.lines.append(
            f"- {path.stem}: CUDA_LAUNCH_BLOCKING={run['launch_blocking'] or 'unset'}, "
            f"world {run.get('world', 1)} (fake process group), {run['steps']} steps: "
            f"{'identical' if same else 'DIFFERENT'}"
            + ("" if finite else " (non-finite losses: the comparison proves nothing)")
        )
        if not same:
            r.fail(f"race {path.stem}")
        if not finite:
            r.fail(f"race {path.stem} not finite")
    if len(runs) < 3:
        r.fail(f"race: {len(runs)} runs found, expected 3")
    r.data["race"] = "identical" if runs and not any("race" in f for f in r.failures) else "FAILED"


def _hook_problems(run: dict[str, Any]) -> list[str]:
    """What makes a stress run's sleeps vacuous: no all-gather or reduce-scatter seen by the
    hook, or (on a device) a call without a stream or off its stream."""
    hook = run.get("hook") or {}
    calls = hook.get("calls", {})
    variant = run.get("variant") or {}
    mesh = variant.get("mesh") or [run.get("world", 1)]
    kinds = []
    if mesh[-1] > 1:  # a shard group of one rank copies instead of gathering and scattering
        kinds += ["all_gather", "reduce_scatter"]
    if variant.get("hsdp"):
        kinds.append("all_reduce")  # the replicas' all-reduce, on its own stream
    problems = [f"no {kind} collective seen by the hook" for kind in kinds if not calls.get(kind)]
    if run["device"] != "cpu" and hook.get("without_stream"):
        problems.append(f"{hook['without_stream']} hook calls without a stream")
    if hook.get("not_current"):
        problems.append(f"{hook['not_current']} hook calls off the collective's stream")
    return problems


def _hook_text(run: dict[str, Any]) -> str:
    hook = run.get("hook") or {}
    calls = hook.get("calls", {})
    sleeps = (
        f"sleep kernels of up to {hook.get('cycles', 0)} cycles"
        if run["device"] != "cpu"
        else f"host sleeps of up to {hook.get('host_s', 0)} s (CPU stand-in)"
    )
    per_kind = ", ".join(f"{k} {v}" for k, v in sorted(calls.items()))
    return f"hook: {sum(calls.values())} calls ({per_kind}), {sleeps}"


def stress(r: Report) -> None:
    r.section(
        "stress race check (sleeps before every collective and around every block, "
        "expandable segments, empty_cache every step, larger dimensions)"
    )
    rows = []
    paths = [p for p in r.out.glob("stress_*.json") if not p.stem.endswith("_serial")]
    paths.sort(key=lambda p: ("_fake" in p.stem, p.stem.endswith("bf16"), p.stem))
    for case in ("fp32", "bf16"):
        if not any(p.stem.endswith(f"_{case}") for p in paths):
            r.lines.append(f"- {case}: missing")
            r.fail(f"stress {case} missing")
    for path in paths:
        run = _load(path)
        assert run is not None
        case = run["case"]
        model = run["model"]
        where = (
            f"rank 0 of {run['world']} on the fake process group"
            if run["backend"] == "fake"
            else f"{run['world']} ranks ({run['backend']})"
        )
        variant = run.get("variant") or {}
        if variant.get("hsdp"):
            where += f", HSDP mesh {variant['mesh']}"
        if variant.get("custom_collectives"):
            where += ", custom collectives"
        if variant.get("inplace_grads"):
            where += ", in-place gradients"
        if variant.get("float8"):
            where += ", FP8 quantized all-gather"
        head = (
            f"- {case}, {where}, {run['steps']} steps, MLP dim {model['dim']} hidden "
            f"{model['hidden']} x {model['layers']} layers, batch {run['batch_per_rank']} per rank"
        )
        problems = _hook_problems(run)
        if run["backend"] == "fake":
            serial = _load(path.with_name(f"{path.stem}_serial.json"))
            if serial is None:
                verdict = "MISSING serial reference"
            else:
                same = run["losses"] == serial["losses"]
                same = same and run["params_sha256"] == serial["params_sha256"]
                finite = all(math.isfinite(float.fromhex(v)) for v in run["losses"])
                verdict = "bitwise equal to the serial run" if same and finite else "MISMATCH"
                if not finite:
                    verdict += " (non-finite losses)"
        else:
            cmp = run.get("compare") or {}
            verdict = cmp.get("verdict", "MISSING comparison")
            detail = (
                f"; losses max rel diff {cmp.get('loss_max_rel_diff', float('nan')):.2e}, "
                f"worst parameter {cmp.get('param_worst') or '-'} "
                f"{cmp.get('param_worst_rel_diff', float('nan')):.2e} of its training movement "
                f"(tolerance {cmp.get('tolerance')})"
                if verdict != "bitwise"
                else ""
            )
            if verdict == "within tolerance" and cmp.get("expected") == "bitwise":
                detail += "; NOTE: bitwise was expected at 2 ranks (same arithmetic)"
            verdict = f"{verdict} vs the one-process reference{detail}"
        r.lines.append(f"{head}: {verdict}; {_hook_text(run)}")
        for problem in problems:
            r.lines.append(f"  - FAILED: {problem} (the sleeps would prove nothing)")
        if "MISMATCH" in verdict or "MISSING" in verdict:
            r.fail(f"stress {path.stem}")
        if problems:
            r.fail(f"stress {path.stem} hook")
        rows.append({"case": case, "where": where, "verdict": verdict.split(";")[0]})
    r.data["stress"] = rows


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def _x(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}x"


def _mib(value: float) -> str:
    return "-" if math.isnan(value) else f"{value / 2**20:.0f}"


def bench_rows(out: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """One row per configuration: ours / FSDP2 from the per-run medians and minimums."""
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for path in sorted(out.glob("bench_*.json")):
        run = _load(path)
        if run is None or run.get("kind") != "bench":
            continue
        runs.setdefault(run["config"], {}).setdefault(run["engine"], []).append(run)
    rows, model = [], None
    for config, engines in runs.items():
        ours, theirs = engines.get("ours", []), engines.get("fsdp2", [])
        sample = (ours or theirs)[0]
        model = sample["model"]

        def stat(side: list[dict[str, Any]], key: str, pick: Callable[..., float]) -> float:
            values = [run[key] for run in side]
            return pick(values) if values else math.nan

        def mem(side: list[dict[str, Any]], key: str) -> float:
            values = [run["memory"][key] for run in side if run.get("memory")]
            return _median([float(v) for v in values])

        row = {
            "config": config,
            "world": sample["world"],
            "backend": sample["backend"],
            "mixed": sample["mixed"],
            "avoid_record_streams": sample["avoid_record_streams"] or "unset",
            "mesh": sample.get("mesh") or [sample["world"]],
            "runs": [len(ours), len(theirs)],
            "ours_ms": stat(ours, "median_ms", _median),
            "fsdp2_ms": stat(theirs, "median_ms", _median),
            "ours_min_ms": stat(ours, "min_ms", min),
            "fsdp2_min_ms": stat(theirs, "min_ms", min),
            "finite": all(math.isfinite(v) for run in ours + theirs for v in run["losses"]),
        }
        if sample["backend"] == "fake":  # no data moves: the other ranks' shards are garbage
            row.update(loss_verdict="not comparable", loss_max_rel_diff=math.nan, loss_rtol=0.0)
        else:
            row.update(_losses_against_fsdp2(ours, theirs, sample["mixed"]))
        row["step_ratio"] = _ratio(row["ours_ms"], row["fsdp2_ms"])
        row["min_ratio"] = _ratio(row["ours_min_ms"], row["fsdp2_min_ms"])
        for key in ("max_allocated", "max_reserved", "alloc_retries"):
            row[f"ours_{key}"] = mem(ours, key)
            row[f"fsdp2_{key}"] = mem(theirs, key)
        row["allocated_ratio"] = _ratio(row["ours_max_allocated"], row["fsdp2_max_allocated"])
        row["reserved_ratio"] = _ratio(row["ours_max_reserved"], row["fsdp2_max_reserved"])
        rows.append(row)
    # real ranks first (most first), TORCH_NCCL_AVOID_RECORD_STREAMS unset before =1, fake last
    rows.sort(
        key=lambda r: (r["backend"] == "fake", -r["world"], r["avoid_record_streams"] != "unset")
    )
    return rows, model


def _losses_against_fsdp2(
    ours: list[dict[str, Any]], theirs: list[dict[str, Any]], mixed: bool
) -> dict[str, Any]:
    """Our losses against FSDP2's in the same command (the same initial weights and batches):
    ``bitwise``, ``within tolerance`` (``LOSS_RTOL`` of the precision: the engines sum
    gradients in other orders across ranks) or ``MISMATCH``, which fails the report, so a fast
    wrong run never passes. Every run of an engine is compared with FSDP2's first run."""
    case = "bf16" if mixed else "fp32"
    if not ours or not theirs:
        return {"loss_verdict": "missing", "loss_max_rel_diff": math.nan, "loss_rtol": 0.0}
    reference = [float(v) for v in theirs[0]["losses"]]
    worst, bitwise = 0.0, True
    for run in ours + theirs[1:]:
        losses = [float(v) for v in run["losses"]]
        if len(losses) != len(reference) or not losses:
            worst, bitwise = math.inf, False
            continue
        for a, b in zip(losses, reference, strict=True):
            if a != b:
                bitwise = False
                rel = abs(a - b) / max(abs(b), 1e-12) if math.isfinite(a - b) else math.inf
                worst = max(worst, rel)
    verdict = (
        "bitwise" if bitwise else "within tolerance" if worst <= LOSS_RTOL[case] else "MISMATCH"
    )
    return {"loss_verdict": verdict, "loss_max_rel_diff": worst, "loss_rtol": LOSS_RTOL[case]}


def _where(row: dict[str, Any]) -> str:
    if row["backend"] == "fake":
        return f"rank 0 of {row['world']}, fake process group (no communication)"
    mesh = row.get("mesh") or [row["world"]]
    hsdp = f", HSDP {mesh[0]} x {mesh[1]}" if len(mesh) == 2 else ""
    return f"{row['world']} x {row['backend']}{hsdp}"


def bench_table(rows: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| ranks | precision | TORCH_NCCL_AVOID_RECORD_STREAMS | runs ours, FSDP2 | step ms ours "
        "vs FSDP2 (median of run medians) | step ours / FSDP2 (min / min) | max allocated MiB "
        "ours vs FSDP2 | allocated ours / FSDP2 | max reserved MiB ours vs FSDP2 | reserved "
        "ours / FSDP2 | allocator retries ours vs FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        retries = (
            "-"
            if math.isnan(row["ours_alloc_retries"])
            else f"{row['ours_alloc_retries']:.0f} vs {row['fsdp2_alloc_retries']:.0f}"
        )
        lines.append(
            f"| {_where(row)} | {'bf16 mixed' if row['mixed'] else 'fp32'} | "
            f"{row['avoid_record_streams']} | {row['runs'][0]}, {row['runs'][1]} | "
            f"{row['ours_ms']:.1f} vs {row['fsdp2_ms']:.1f} | {_x(row['step_ratio'])} "
            f"({_x(row['min_ratio'])}) | {_mib(row['ours_max_allocated'])} vs "
            f"{_mib(row['fsdp2_max_allocated'])} | {_x(row['allocated_ratio'])} | "
            f"{_mib(row['ours_max_reserved'])} vs {_mib(row['fsdp2_max_reserved'])} | "
            f"{_x(row['reserved_ratio'])} | {retries} |"
        )
    return lines


def bench(r: Report) -> None:
    r.section("ours vs FSDP2 side by side (separate processes, alternating runs)")
    rows, model = bench_rows(r.out)
    if not rows:
        r.lines.append("- missing: no bench_*.json")
        r.fail("bench missing")
    for row in rows:
        if min(row["runs"]) == 0:
            r.fail(f"bench {row['config']}: no runs of one engine")
        if not row["finite"]:
            r.fail(f"bench {row['config']}: non-finite losses")
        if row["loss_verdict"] not in ("bitwise", "within tolerance", "not comparable"):
            r.fail(f"bench {row['config']}: losses ours vs FSDP2 {row['loss_verdict']}")
        r.lines.append(
            f"- losses ours vs FSDP2, {row['config']} ({_where(row)}): {row['loss_verdict']}"
            + (
                ""
                if row["loss_verdict"] == "bitwise"
                else " (the fake process group gathers no other rank's shard)"
                if row["loss_verdict"] == "not comparable"
                else f" (max relative difference {row['loss_max_rel_diff']:.2e}, "
                f"tolerance {row['loss_rtol']:.0e})"
            )
        )
    if rows and not any(row["backend"] != "fake" and row["world"] > 1 for row in rows):
        r.lines.append(
            "- one device: no step-time ratio here has real communication (world size 1 issues "
            "no collectives; the fake process group's collectives move no data; NCCL refuses "
            "two ranks on one device). What this run shows: memory (max allocated / reserved), "
            "the copies and kernel launches of each engine. Step-time ratios with real "
            "communication need >= 2 GPUs (8 for the intended figures)."
        )
    if rows:
        r.lines.append("")
    if model is not None:
        r.lines.append(
            f"LLaMA-like model: dim {model['dim']}, {model['layers']} layers, {model['heads']} "
            f"heads, FFN {model['ffn']}, vocab {model['vocab']}, {model['seq']} tokens x "
            f"{model['batch_per_rank']} sequences per rank, {model['parameters'] / 1e6:.3g}M "
            "parameters; AdamW. Step: forward, backward, optimizer step, zero_grad, the "
            "slowest rank's time between a barrier and a device synchronize. Memory: "
            "`torch.cuda.max_memory_allocated` / `max_memory_reserved` over every step (the "
            "largest over ranks), median over runs. Ratios < 1: ours faster or smaller."
        )
        r.lines.append("")
    table = bench_table(rows)
    r.lines += table
    r.data["bench"] = {"model": model, "rows": rows}
    (r.out / "gpu_bench.md").write_text("\n".join(table) + "\n")


def sanitizer(r: Report) -> None:
    path = r.out / "sanitizer.txt"
    verdict = path.read_text().strip() if path.exists() else "(missing)"
    r.section("CUDA sanitizer (TORCH_CUDA_SANITIZER=1, 5 steps of the race run)")
    r.lines.append(f"- {verdict}")
    r.data["sanitizer"] = verdict
    if not verdict.startswith(("passed", "not run")):
        r.fail("sanitizer")
        log = r.out / "sanitizer.log"
        if log.exists():
            r.lines += ["", "```", *log.read_text().splitlines()[-40:], "```"]


def host(r: Report) -> None:
    path = r.out / "scale_host.md"
    r.section("host benchmark (fake process group, device tensors)")
    r.lines.append(path.read_text() if path.exists() else "(missing)")
    if not path.exists():
        r.fail("host missing")


def launches(r: Report) -> None:
    rows = _launches(r.out)
    r.data["launches"] = rows
    bad = [row for row in rows if row["rc"] != "0"]
    if not bad:
        return
    r.section("launches that failed, timed out or were skipped")
    for row in bad:
        why = {
            "skipped": "skipped: the time budget was spent",
            "124": f"timed out after {row['limit']} s",
            "137": f"killed after {row['limit']} s",
        }.get(row["rc"], f"exit status {row['rc']}")
        r.lines.append(f"- {row['name']}: {why}")
        r.fail(f"launch {row['name']} ({why})")
        log = r.out / "logs" / f"{row['name']}.log"
        if log.exists() and row["rc"] != "skipped":
            r.lines += ["", "```", *log.read_text().splitlines()[-20:], "```", ""]


SECTIONS: dict[str, Callable[[Report], None]] = {
    "parity": parity,
    "race": race,
    "stress": stress,
    "bench": bench,
    "sanitizer": sanitizer,
    "host": host,
}


def report(out: Path, parts: list[str], dry: bool) -> int:
    r = Report(out)
    machine = _load(out / "preflight.json") or {}
    r.lines += [
        "# gpu_check" + (" (DRY RUN on CPU: not GPU figures)" if dry else ""),
        "",
        f"{machine.get('date', '?')}; {machine.get('device_name', '?')} x "
        f"{machine.get('gpus', '?')}; torch {machine.get('torch', '?')} (CUDA "
        f"{machine.get('cuda', '-')}, NCCL {machine.get('nccl', '-')}); engine compat "
        f"{machine.get('compat', '?')}; commit {machine.get('commit', '?')}; parts: "
        f"{', '.join(parts)}",
    ]
    if machine.get("shims"):
        r.lines.append(f"\nOn this torch, for these runs only: {'; '.join(machine['shims'])}.")
    for part in parts:
        SECTIONS[part](r)
    launches(r)
    verdict = "passed" if not r.failures else "FAILED: " + ", ".join(r.failures)
    r.lines += ["", "result: " + verdict]
    text = "\n".join(r.lines) + "\n"
    (out / "summary.md").write_text(text)
    summary = {"dry": dry, "machine": machine, "parts": parts, "result": verdict, **r.data}
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1, default=str))
    print(text)
    return 1 if r.failures else 0
