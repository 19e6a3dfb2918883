"""Fit the projection's alpha-beta collective model to gloo on this machine, then predict a
held-out run.

The projection models a ring collective over ``m`` ranks with ``S`` bytes per rank as
``T = (m - 1) * (alpha + S * beta)`` (``shard_planner`` ``hardware`` Note), plus, where a
backend copies the whole buffer locally, ``m * S * gamma`` at memory bandwidth (gloo's
reduce-scatter clones its ``m * S`` input and all-reduces it, so its ring moves ``2 (m - 1)``
steps of ``S`` and it copies ``m S``; the fit finds that). The constants are fitted, per
collective, by least squares on one sweep of gloo all-gathers and reduce-scatters (``m`` in
``FIT_WORLDS``, ``S`` in ``FIT_SIZES``), then a second, separate run at sizes and world sizes the
fit never saw (``HELD_OUT``) is predicted from them. Each point is the minimum over ``REPS`` timed
calls after a barrier (the minimum: other jobs on a shared machine only ever add time). The relative
error of every held-out prediction is printed; ``tests/test_projection_gloo.py`` asserts it is
within 15%.

Run: ``python benchmarks/bench_projection_gloo.py [--out results]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

FIT_WORLDS = (2, 3)
FIT_SIZES = (1 << 18, 1 << 19, 1 << 20, 1 << 21, 1 << 22, 1 << 23)  # 256 KiB .. 8 MiB a rank
HELD_OUT = ((2, 3 << 20), (3, 3 << 20), (2, 3 << 18), (3, 3 << 21))  # (m, bytes per rank)
REPS = 25
OPS = ("all_gather", "reduce_scatter")


def _once(op: str, shard: torch.Tensor, full: torch.Tensor) -> float:
    """One collective (fp32), every rank started together; the slowest rank's time."""
    dist.barrier()
    start = time.perf_counter()
    if op == "all_gather":
        dist.all_gather_single(full, shard)
    else:
        dist.reduce_scatter_single(shard, full)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    # the collective ends when every rank has its data
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def sweep(rank: int, world: int, points: list[tuple[str, int]], reps: int) -> list[float]:
    """Worker: the minimum time of each (op, bytes per rank) over ``reps`` rounds; every round
    times every point once, so slow phases of a shared machine hit all points alike."""
    torch.set_num_threads(1)
    buffers = {size: (torch.ones(size // 4), torch.ones(size // 4 * world)) for _, size in points}
    for op, size in points:  # warm up buffers and connections
        _once(op, *buffers[size])
    best = [float("inf")] * len(points)
    for _ in range(reps):
        for i, (op, size) in enumerate(points):
            best[i] = min(best[i], _once(op, *buffers[size]))
    return best


def measure(points: list[tuple[str, int, int]], reps: int = REPS) -> list[dict[str, Any]]:
    """Time every (op, m, bytes) point, one process group per world size."""
    from ragged_dtensor.testing import run_processes

    out = []
    for m in sorted({p[1] for p in points}):
        here = [(op, size) for op, world, size in points if world == m]
        times = run_processes(sweep, m, here, reps, timeout=900)[0]
        out += [
            {"op": op, "world": m, "bytes": size, "seconds": t}
            for (op, size), t in zip(here, times, strict=True)
        ]
    return out


Constants = dict[str, tuple[float, float, float]]


def _features(world: int, size: int) -> list[float]:
    return [world - 1, (world - 1) * size, world * size]


def fit(samples: list[dict[str, Any]]) -> Constants:
    """Least squares of ``T = (m-1) alpha + (m-1) S beta + m S gamma`` per op, weighted by
    ``1/T`` so that small and large messages count alike (relative errors):
    ``{op: (alpha, beta, gamma)}``."""
    constants = {}
    for op in OPS:
        rows = [s for s in samples if s["op"] == op]
        a = np.array([_features(s["world"], s["bytes"]) for s in rows], float)
        t = np.array([s["seconds"] for s in rows], float)
        w = 1.0 / t
        (alpha, beta, gamma), *_ = np.linalg.lstsq(a * w[:, None], t * w, rcond=None)
        constants[op] = (float(alpha), float(beta), float(gamma))
    return constants


def predict(constants: Constants, op: str, world: int, size: int) -> float:
    return float(np.dot(constants[op], _features(world, size)))


def run(reps: int = REPS) -> dict[str, Any]:
    fit_points = [(op, m, s) for op in OPS for m in FIT_WORLDS for s in FIT_SIZES]
    held_points = [(op, m, s) for op in OPS for m, s in HELD_OUT]
    # measured in the same rounds (see ``sweep``); the held-out points never enter the fit
    every = measure(fit_points + held_points, reps)
    samples = [x for x in every if (x["op"], x["world"], x["bytes"]) in set(fit_points)]
    constants = fit(samples)
    held = [x for x in every if (x["op"], x["world"], x["bytes"]) in set(held_points)]
    for h in held:
        h["predicted"] = predict(constants, h["op"], h["world"], h["bytes"])
        h["error"] = h["predicted"] / h["seconds"] - 1
    return {"constants": constants, "fit": samples, "held_out": held}


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| op | alpha (us per step) | 1/beta (GB/s per link) | 1/gamma (GB/s local copy) |",
        "|---|---:|---:|---:|",
    ]
    for op, (alpha, beta, gamma) in result["constants"].items():
        copy = f"{1e-9 / gamma:.2f}" if gamma > 0 else "none"
        lines.append(f"| {op} | {alpha * 1e6:.1f} | {1e-9 / beta:.2f} | {copy} |")
    lines += [
        "",
        "| held-out op | m | MiB per rank | measured ms | predicted ms | error |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for h in result["held_out"]:
        lines.append(
            f"| {h['op']} | {h['world']} | {h['bytes'] / 2**20:g} | {1e3 * h['seconds']:.2f} "
            f"| {1e3 * h['predicted']:.2f} | {100 * h['error']:+.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, help="folder for bench_projection_gloo.{json,md}")
    parser.add_argument("--reps", type=int, default=REPS)
    args = parser.parse_args(argv)
    result = run(args.reps)
    text = markdown(result)
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_projection_gloo.json").write_text(json.dumps(result, indent=1))
        header = (
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
            f"torch {torch.__version__}; load average {os.getloadavg()}\n\n"
        )
        (args.out / "bench_projection_gloo.md").write_text(header + text + "\n")


if __name__ == "__main__":
    sys.exit(main())
