"""RaggedShard vs Shard(0) redistribution time, side by side in one run (2 gloo processes).

For the same tensors: RaggedShard -> Replicate against Shard(0) -> Replicate (all-gather), and
Partial -> RaggedShard against Partial -> Shard(0) (reduce-scatter). Runs alternate, every case is
timed ``--steps`` times after warm-up; we report medians, minimums and the ratio ours / torch's.

    python packages/ragged-dtensor/benchmarks/bench_ragged.py [--steps 30] [--out results]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor, init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_processes

# (rows, cols): a LLaMA-like block's weights at CPU scale, one with an odd row count
SHAPES = [(1024, 1024), (2752, 1024), (1001, 512)]


def _ragged_for(shape: tuple[int, int], world: int) -> RaggedShard:
    """The layout a planner gives: equal element shares when they exist, else row units."""
    numel = shape[0] * shape[1]
    if numel % world == 0:
        return RaggedShard((0, 1), (1,) * world)
    return RaggedShard((0,), tuple(1 for _ in range(world)))


def _time(fn: object, steps: int) -> list[float]:
    assert callable(fn)
    out = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def _body(rank: int, world: int, steps: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, dict[str, float]] = {}
    for shape in SHAPES:
        full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
        ragged = _ragged_for(shape, world)
        d_ragged = distribute_tensor(full, mesh, [ragged])
        d_shard = distribute_tensor(full, mesh, [Shard(0)])
        partial = DTensor.from_local(full.clone(), mesh, [Partial()], run_check=False)
        cases = {
            "gather/ours": lambda d=d_ragged: d.redistribute(mesh, [Replicate()]).to_local(),
            "gather/torch": lambda d=d_shard: d.redistribute(mesh, [Replicate()]).to_local(),
            "reduce_scatter/ours": lambda r=ragged, p=partial: p.redistribute(mesh, [r]).to_local(),
            "reduce_scatter/torch": lambda p=partial: p.redistribute(mesh, [Shard(0)]).to_local(),
        }
        for fn in cases.values():  # warm-up
            fn()
        samples: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(steps):  # alternate so drift hits both sides alike
            for name, fn in cases.items():
                samples[name].extend(_time(fn, 1))
        key = f"{shape[0]}x{shape[1]}"
        for name, values in samples.items():
            results[f"{key} {name}"] = {
                "median_ms": statistics.median(values) * 1e3,
                "min_ms": min(values) * 1e3,
            }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("results"))
    args = parser.parse_args()
    per_rank = run_processes(_body, args.world, args.steps, timeout=900)
    # a collective is as slow as its slowest rank
    merged = {k: {m: max(r[k][m] for r in per_rank) for m in per_rank[0][k]} for k in per_rank[0]}
    rows = []
    for shape in SHAPES:
        key = f"{shape[0]}x{shape[1]}"
        for op in ("gather", "reduce_scatter"):
            ours, theirs = merged[f"{key} {op}/ours"], merged[f"{key} {op}/torch"]
            rows.append(
                {
                    "shape": key,
                    "op": op,
                    "ours_median_ms": round(ours["median_ms"], 3),
                    "torch_median_ms": round(theirs["median_ms"], 3),
                    "ratio_median": round(ours["median_ms"] / theirs["median_ms"], 3),
                    "ours_min_ms": round(ours["min_ms"], 3),
                    "torch_min_ms": round(theirs["min_ms"], 3),
                    "ratio_min": round(ours["min_ms"] / theirs["min_ms"], 3),
                }
            )
    header = (
        "| tensor | op | RaggedShard median ms | Shard(0) median ms | ratio | "
        "RaggedShard min ms | Shard(0) min ms | ratio (min) |"
    )
    lines = [
        f"RaggedShard vs Shard(0), world size {args.world}, gloo, fp32, "
        f"{args.steps} alternating steps",
        "",
        header,
        "|---" * 8 + "|",
    ]
    for r in rows:
        op = (
            "RS->Replicate vs S(0)->Replicate"
            if r["op"] == "gather"
            else ("Partial->RS vs Partial->S(0)")
        )
        lines.append(
            f"| {r['shape']} | {op} | {r['ours_median_ms']} | {r['torch_median_ms']} | "
            f"{r['ratio_median']} | {r['ours_min_ms']} | {r['torch_min_ms']} | "
            f"{r['ratio_min']} |"
        )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_ragged.md").write_text(table + "\n")
    (args.out / "bench_ragged.json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
