"""Setup cost of many small parameters: ``fully_shard`` plus the first step, ours vs torch FSDP2.

The model is ``nn.Sequential`` of ``--layers`` ``Linear(2, 2)`` (5,000 by default: 10,000
parameters), sharded by **one** ``fully_shard`` call on the root (one group of every
parameter, the case where per-parameter setup work adds up). In the same gloo processes (two
ranks by default), each engine shards its own copy of the same model (same initial weights)
and runs one step (forward, backward, ``SGD.step()``, ``zero_grad``), alternating which engine
goes first round by round (``--rounds``). Times are rank 0's wall clock, with a barrier before
and after each phase; the ratio is the median over rounds of ours / FSDP2 for the same round.

    python benchmarks/bench_setup.py                 # 5,000 layers, 2 ranks, 2 rounds
    python benchmarks/bench_setup.py --profile       # + cProfile of our setup on rank 0

``--profile`` prints the 30 costliest functions (cumulative; then 20 by own time) of our
``fully_shard`` + first step on rank 0, after the timed rounds.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard as ours_fully_shard
from ragged_dtensor.testing import run_processes

ENGINES = {"ours": ours_fully_shard, "fsdp2": fsdp2_fully_shard}


def _timed_setup(engine: str, base: nn.Module, mesh: Any) -> dict[str, float]:
    model = copy.deepcopy(base)
    dist.barrier()
    start = time.perf_counter()
    ENGINES[engine](model, mesh=mesh)
    dist.barrier()
    sharded = time.perf_counter()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.ones(4, 2)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    dist.barrier()
    stepped = time.perf_counter()
    return {"fully_shard": sharded - start, "step": stepped - sharded, "total": stepped - start}


def _rank(rank: int, world: int, layers: int, rounds: int, profile: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    base = nn.Sequential(*[nn.Linear(2, 2) for _ in range(layers)])
    mesh = init_device_mesh("cpu", (world,))
    times: dict[str, list[dict[str, float]]] = {name: [] for name in ENGINES}
    for r in range(rounds):
        for engine in ENGINES if r % 2 == 0 else reversed(list(ENGINES)):
            times[engine].append(_timed_setup(engine, base, mesh))
    report = ""
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        _timed_setup("ours", base, mesh)
        prof.disable()
        out = io.StringIO()
        stats = pstats.Stats(prof, stream=out)
        stats.sort_stats("cumulative").print_stats(30)
        stats.sort_stats("tottime").print_stats(20)
        report = out.getvalue()
    return {"times": times, "profile": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=5000)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    results = run_processes(
        _rank, args.world, args.layers, args.rounds, args.profile, timeout=args.timeout
    )
    times = results[0]["times"]
    print(f"{args.layers} x Linear(2, 2), one fully_shard on the root, {args.world} gloo ranks")
    print("| engine | phase | median s | all rounds s |")
    print("|---|---|---:|---|")
    for engine in ENGINES:
        for phase in ("fully_shard", "step", "total"):
            values = [t[phase] for t in times[engine]]
            shown = ", ".join(f"{v:.2f}" for v in values)
            print(f"| {engine} | {phase} | {statistics.median(values):.2f} | {shown} |")
    for phase in ("fully_shard", "total"):
        ratios = [o[phase] / f[phase] for o, f in zip(times["ours"], times["fsdp2"], strict=True)]
        print(f"ours / FSDP2, {phase}: {statistics.median(ratios):.2f}x (median over rounds)")
    if args.profile:
        print(results[0]["profile"])


if __name__ == "__main__":
    main()
