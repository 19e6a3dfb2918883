"""Every catalogue group x granularity x world size 8..16384: ours vs the bound and baselines.

Run: ``python packages/shard-planner/benchmarks/bench_planner_sweep.py [--json out.json]``.
Prints the summary quoted in the README (gaps to the lower bound, cases worse or better than a
baseline, planning times). Figures, not pass/fail; times are the CPU time of this process
(``time.process_time``), so other jobs on a shared machine inflate them less than wall time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import shard_planner as sp
from shard_planner.projection import MODELS, catalogue_model

WORLDS = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
ROWS = (1, 16, 32, 128)
ALIGN = 8  # 16 bytes of bf16


def _cases() -> list[dict[str, Any]]:
    cases = []
    for name in MODELS:
        for group in catalogue_model(name).groups:
            for rows in ROWS:
                specs = group.specs(rows)
                for world in WORLDS:
                    start = time.process_time()
                    ours = sp.plan(specs, world, ALIGN)
                    seconds = time.process_time() - start
                    naive = sp.naive_plan(specs, world, ALIGN).shard_size
                    megatron = sp.megatron_plan(specs, world, ALIGN).shard_size
                    paper = sp.plan(specs, world, ALIGN, method="paper").shard_size
                    cases.append(
                        {
                            "model": name,
                            "group": group.name,
                            "rows": rows,
                            "world": world,
                            "tensors": len(specs),
                            "numel": group.numel,
                            "seconds": seconds,
                            "ours": ours.shard_size,
                            "bound": sp.lower_bound(specs, world, ALIGN),
                            "simple": min(naive, megatron),
                            "paper": paper,
                        }
                    )
    return cases


def _pct(case: dict[str, Any], key: str) -> float:
    return 100.0 * (case["world"] * case[key] - case["numel"]) / case["numel"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="also write every case to this file")
    parser.add_argument("--out", type=Path, help="folder: bench_planner_sweep.json there")
    args = parser.parse_args()
    if args.out is not None and not args.json:
        args.out.mkdir(parents=True, exist_ok=True)
        args.json = str(args.out / "bench_planner_sweep.json")
    cases = _cases()
    print(f"{len(cases)} cases (group x rows x world)")
    tight = sum(c["ours"] == c["bound"] for c in cases)
    print(f"ours == lower bound (provably optimal): {tight}")
    for rows in ROWS:
        gap = max(_pct(c, "ours") - _pct(c, "bound") for c in cases if c["rows"] == rows)
        print(f"max gap to the bound, {rows}-row blocks: {gap:.3f} points")
    over = [c for c in cases if c["rows"] == 128 and _pct(c, "bound") < 3 and _pct(c, "ours") > 3]
    print(f"128-row cases over 3% where the bound is under 3%: {len(over)}")
    worse = [c for c in cases if c["ours"] > min(c["simple"], c["paper"])]
    print(f"cases worse than any of naive/megatron/paper: {len(worse)}")
    for key, label in (("simple", "the better of naive/megatron"), ("paper", "paper")):
        better = [c for c in cases if c["ours"] < c[key]]
        line = f"cases strictly better than {label}: {len(better)}"
        useful = [c for c in better if _pct(c, "ours") <= 10.0]  # plans one would deploy
        if useful:
            most = max(useful, key=lambda c: _pct(c, key) - _pct(c, "ours"))
            line += (
                f"; largest: {most['model']} {most['group']}, {most['rows']} rows, "
                f"{most['world']} ranks: {_pct(most, 'ours'):.2f}% vs "
                f"{_pct(most, key):.2f}%"
            )
        print(line)
    at_max = [c for c in cases if c["world"] == WORLDS[-1]]
    slowest = max(at_max, key=lambda c: c["seconds"])
    print(
        f"slowest plan at {WORLDS[-1]} ranks: {1e3 * slowest['seconds']:.1f} ms "
        f"({slowest['model']} {slowest['group']}, {slowest['tensors']} tensors, "
        f"{slowest['rows']} rows)"
    )
    print(f"slowest plan overall: {1e3 * max(c['seconds'] for c in cases):.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(cases, indent=1), encoding="utf-8")


if __name__ == "__main__":
    main()
