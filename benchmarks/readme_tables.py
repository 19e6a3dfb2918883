"""Write the README's benchmark tables from the benchmarks' JSON output (never by hand).

Reads ``results/bench_engine.json`` and ``results/bench_optim_engine.json`` (written by
``bench_engine.py`` and ``bench_optim_engine.py``; ``nox -s bench`` runs all three) and
``results/gpu_check/gpu_check.json`` (written by ``benchmarks/gpu_check.sh`` on a GPU machine;
until it exists the GPU section says the check was not run) and replaces the text between each
pair of markers in ``README.md``::

    <!-- generated: bench_engine (benchmarks/readme_tables.py) -->
    ...
    <!-- end generated: bench_engine -->

    python benchmarks/readme_tables.py [--results results] [--readme README.md] [--check]

``--check`` exits 1 if the README differs from what the JSON gives (for CI or review);
``--only NAME...`` writes (or checks) those sections and leaves the others as they are. JSON
written by an older version of a benchmark (missing a field, or measuring something the
section's text no longer describes) is refused with the benchmark to rerun.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _cell(value: float | None, fmt: str = ".2f", suffix: str = "x") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{fmt}}{suffix}"


def engine_section(data: dict[str, Any]) -> str:
    """The side-by-side engine table (ours vs FSDP2 / FSDP1 / DeepSpeed) and its reading."""
    info, rows = data["machine"], data["rows"]
    stale = [r for r in rows if r["engine"] == "ours" and r["optimizer"] == "torch AdamW"]
    if stale:  # before FlatAdamW became ours' AdamW: the text below would misdescribe it
        raise KeyError("optimizer 'optim_blockwise.FlatAdamW' on the AdamW cases")
    # The name the run recorded (results older than the move say fsdp_engine.FlatAdamW: the same
    # optimizer, bit for bit), and where it lives now if that differs.
    recorded = sorted({r["optimizer"] for r in rows if r["optimizer"].endswith("FlatAdamW")})
    flat = recorded[0] if recorded else "optim_blockwise.FlatAdamW"
    if flat != "optim_blockwise.FlatAdamW":
        flat += "` (now `optim_blockwise.FlatAdamW`)"
    else:
        flat += "`"
    by_key: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_key.setdefault((r["case"], r["world"]), {})[r["engine"]] = r
    steps = data["args"]["steps"]
    out = [
        f"{info['date']}; {info['cpu']}, {info['nproc']} cores; torch {info['torch']}, gloo, "
        f"fp32; load average at the end {info['load']}; commit {info['commit']}. "
        f"`python benchmarks/bench_engine.py` (`nox -s bench`). One run per world size, engines "
        f"alternating step by step on the same model, data and optimizer; {steps} timed steps "
        "after warm-up. Ratios are ours / peer (< 1: ours faster or smaller); step ratio = median "
        "of the paired per-step ratios (min / min in brackets). Memory: peak live storage per "
        f"rank. AdamW cases: ours `{flat}, the peers `torch.optim.AdamW`, the same "
        "two param groups (decay on matrices, none on norms); the last two columns are ours with "
        "per-parameter `torch.optim.AdamW` instead.",
        "",
        "| case | world | ours / FSDP2 | ours / FSDP1 | ours / DeepSpeed | optimizer step ours / "
        "FSDP2 | memory ours / FSDP2 | / FSDP1 | / DeepSpeed | collectives ours vs FSDP2 "
        "(count, MiB) | copied MiB ours vs FSDP2 | ours + torch AdamW: step / FSDP2 | "
        "ours + torch AdamW: memory / FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (case, world), engines in by_key.items():
        ours, fsdp2 = engines.get("ours"), engines.get("fsdp2")
        if ours is None or fsdp2 is None:
            continue
        alt = engines.get("ours-torch-adamw")
        step = f"{_cell(ours['paired_vs']['fsdp2'])} ({_cell(ours['min_vs_fsdp2'])})"
        alt_step = (
            f"{_cell(alt['paired_vs']['fsdp2'])} ({_cell(alt['min_vs_fsdp2'])})" if alt else "-"
        )
        out.append(
            f"| {case} | {world} | {step} | {_cell(ours['paired_vs'].get('fsdp1'))} | "
            f"{_cell(ours['paired_vs'].get('deepspeed'))} | {_cell(ours['opt_vs_fsdp2'])} | "
            f"{_cell(ours['mem_vs']['fsdp2'])} | {_cell(ours['mem_vs'].get('fsdp1'))} | "
            f"{_cell(ours['mem_vs'].get('deepspeed'))} | "
            f"{ours['collectives']} vs {fsdp2['collectives']}, "
            f"{ours['collective_mib']:.1f} vs {fsdp2['collective_mib']:.1f} | "
            f"{ours['copied_mib']:.1f} vs {fsdp2['copied_mib']:.1f} | {alt_step} | "
            f"{_cell(alt['mem_vs']['fsdp2']) if alt else '-'} |"
        )
    dense = [
        e["ours"]
        for (case, _), e in by_key.items()
        if "ours" in e and "fsdp2" in e and case.startswith(("dense", "MoE"))
    ]
    if dense:
        steps_vs = [r["paired_vs"]["fsdp2"] for r in dense]
        copies = [
            by_key[(r["case"], r["world"])]["fsdp2"]["copied_mib"] / max(r["copied_mib"], 1e-9)
            for r in dense
        ]
        out += [
            "",
            f"Reading (AdamW cases): ours takes {min(steps_vs):.2f}-{max(steps_vs):.2f}x FSDP2's "
            f"step time and copies {min(copies):.1f}-{max(copies):.1f}x fewer bytes with the same "
            "collectives; full table, notes and chart in `results/bench_engine*`.",
        ]
    return "\n".join(out)


def optim_section(data: dict[str, Any]) -> str:
    """Our optimizers on our engine vs what users run on FSDP2 (one row per case and world)."""
    info, rows = data["machine"], data["rows"]
    model = data["model"]
    out = [
        f"{info['date']}; {info['cpu']}, {info['nproc']} cores (load average at the end "
        f"{info['load']}); torch {info['torch']}, torchao {info['torchao']}; commit "
        f"{info['commit']}. `python benchmarks/bench_optim_engine.py`: the demo's medium model "
        f"(dim {model['dim']}, {model['layers']} layers, FFN {model['ffn']}, {model['seq']} "
        "tokens), sides alternating step by step in one run per world size. opt / fwd+bwd: the "
        "optimizer step's median time as a share of forward+backward's. Ratios ours / peer (< 1: "
        "ours faster or smaller). Transient: peak live memory of `step()` beyond parameters, "
        "gradients and state, per parameter element (`dbuffer.testing.LiveBytes`).",
        "",
        "| optimizer | world | ours: opt / fwd+bwd | peer | peer: opt / fwd+bwd | step ours / "
        "peer | opt step ours / peer | transient B/elem ours vs peer | ops per parameter ours "
        "vs peer | state ours / peer | ours vs one device (same batches) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ours_rows = {(r["case"], r["world"]): r for r in rows if r["side"] == "ours"}
    for r in rows:
        if r["side"] == "ours":
            continue
        o = ours_rows[(r["case"], r["world"])]
        same = o["max_abs_diff_vs_1dev_same_data"]
        exact = "bit-identical" if same == 0.0 else _cell(same, ".1e", "")
        out.append(
            f"| {r['case']} | {r['world']} | {100 * o['opt_share']:.1f}% | {r['label']} | "
            f"{100 * r['opt_share']:.1f}% | {_cell(r['ours_step_over_this'])} | "
            f"{_cell(r['ours_opt_over_this'], '.3f')} | "
            f"{o['transient_per_element']:.2f} vs {r['transient_per_element']:.2f} | "
            f"{o['ops_per_param']:.0f} vs {r['ops_per_param']:.0f} | "
            f"{_cell(r['ours_state_over_this'])} | {exact} |"
        )
    muon4 = ours_rows.get(("Muon", 4))
    if muon4 is not None:
        verdict = "meets" if muon4["opt_share"] <= 0.05 else "misses"
        out += [
            "",
            f"Muon's optimizer step at world size 4 is {100 * muon4['opt_share']:.1f}% of "
            f"forward+backward ({verdict} the 5% target).",
        ]
    return "\n".join(out)


def gpu_section(data: dict[str, Any] | None) -> str:
    """The GPU check's verdicts and its side-by-side table (``gpu_check.json``), or that it was
    not run."""
    if data is None:
        return (
            "**Not run yet**: no GPU was available to this work, so there are no GPU figures. "
            "`bash benchmarks/gpu_check.sh` on a machine with CUDA GPUs writes "
            "`results/gpu_check/` (`summary.md`, `gpu_bench.md`, `gpu_check.json`); "
            "`python benchmarks/readme_tables.py --only gpu_check` then writes this section "
            "from `results/gpu_check/gpu_check.json`."
        )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_check_report import bench_table

    m = data["machine"]
    out = [
        ("DRY RUN on CPU (not GPU figures). " if data.get("dry") else "")
        + f"{m['date']}; {m['device_name']} x {m['gpus']}; torch {m['torch']} (CUDA "
        f"{m['cuda']}, NCCL {m['nccl']}); commit {m['commit']}. `bash benchmarks/gpu_check.sh` "
        f"(parts: {', '.join(data['parts'])}): **{data['result']}**; everything in "
        "`results/gpu_check/summary.md`.",
        "",
    ]
    if "parity" in data:
        cases = ", ".join(f"{case} {verdict}" for case, verdict in data["parity"].items())
        out.append(f"- parity with FSDP2 at world size 1 (losses and parameters): {cases}")
    if "race" in data:
        out.append(f"- stream race, rank 0 of 4 on the fake process group: {data['race']}")
    for row in data.get("stress", []):
        out.append(f"- stress race check, {row['case']}, {row['where']}: {row['verdict']}")
    if "sanitizer" in data:
        out.append(f"- CUDA sanitizer: {data['sanitizer']}")
    bench = data.get("bench")
    if bench and bench.get("rows"):
        model = bench["model"]
        out += [
            "",
            f"Ours vs FSDP2, each run its own launch, alternating; LLaMA-like model, dim "
            f"{model['dim']}, {model['layers']} layers, {model['seq']} tokens x "
            f"{model['batch_per_rank']} sequences per rank, {model['parameters'] / 1e6:.3g}M "
            "parameters, bf16 mixed precision, AdamW. Step ratio: median of the runs' medians "
            "(min / min in brackets); memory: `max_memory_allocated` / `max_memory_reserved`, "
            "the largest rank, median over runs. Ratios < 1: ours faster or smaller.",
            "",
            *bench_table(bench["rows"]),
        ]
    return "\n".join(out)


SECTIONS: dict[str, Callable[[Any], str]] = {
    "bench_engine": engine_section,
    "bench_optim_engine": optim_section,
    "gpu_check": gpu_section,
}
# where a section's JSON is, under --results (default: NAME.json); those in OPTIONAL render
# without it (the GPU check runs only where a GPU is at hand)
SOURCES = {"gpu_check": "gpu_check/gpu_check.json"}
OPTIONAL = {"gpu_check"}


def render(readme: str, results: Path, only: list[str] | None = None) -> str:
    for name, make in SECTIONS.items():
        if only is not None and name not in only:
            continue
        begin = f"<!-- generated: {name} (benchmarks/readme_tables.py) -->"
        end = f"<!-- end generated: {name} -->"
        pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), flags=re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README has no markers {begin!r} ... {end!r}")
        source = results / SOURCES.get(name, f"{name}.json")
        data = None
        if source.exists():
            data = json.loads(source.read_text())
        elif name not in OPTIONAL:
            raise SystemExit(f"{source} is missing: run benchmarks/{name}.py first")
        if data is not None and data.get("dry"):
            raise SystemExit(f"{source} is a --dry run's (CPU): not figures for the README")
        try:
            block = f"{begin}\n{make(data)}\n{end}"
        except KeyError as exc:
            script = "gpu_check.sh" if name == "gpu_check" else f"{name}.py"
            raise SystemExit(
                f"{source} lacks {exc}: it was written by an older benchmark; rerun "
                f"benchmarks/{script}"
            ) from exc
        readme = pattern.sub(lambda _m, block=block: block, readme)
    return readme


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "results"))
    p.add_argument("--readme", default=str(ROOT / "README.md"))
    p.add_argument("--check", action="store_true", help="fail if the README is not up to date")
    p.add_argument(
        "--only", nargs="+", choices=sorted(SECTIONS), help="these sections (default: all)"
    )
    p.add_argument("--out", help="ignored (nox passes it to every benchmark script)")
    args = p.parse_args(argv)
    path = Path(args.readme)
    old = path.read_text()
    new = render(old, Path(args.results), args.only)
    if args.check:
        sys.exit(0 if new == old else 1)
    path.write_text(new)
    print(f"{path}: benchmark tables written from {args.results}")


if __name__ == "__main__":
    main()
