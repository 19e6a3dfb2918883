"""Where does a step's time go? torch.profiler on ours vs FSDP2 for one benchmark case.

Runs ``--steps`` training steps of the chosen case (default the MoE-like model) for ours and FSDP2
in the same 2 gloo processes (alternating, after warm-up) under ``torch.profiler`` and prints, for
rank 0, the top operators by self CPU time and the time in forward+backward vs the optimizer.

    python benchmarks/profile_engine.py [--case "MoE 16 experts"] [--world 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch
import torch.distributed as dist
from bench_engine import build_runner, cases
from llama import get_batch, load_corpus
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile


def worker(rank: int, world: int, case_name: str, steps: int, top: int, quick: bool) -> Any:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    case = next(c for c in cases(quick) if c.name == case_name)
    cfg = case.model.with_vocab(corpus.vocab)
    runners = [build_runner(case, e, cfg, mesh) for e in ("ours", "fsdp2")]
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [get_batch(corpus.train, gen, case.batch, cfg.seq) for _ in range(steps + 2)]
    for tokens in batches[:2]:  # warm-up
        for r in runners:
            r.step(tokens)
            r.opt_step()
    report = []
    for r in runners:
        fb = opt = 0.0
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for tokens in batches[2:]:
                dist.barrier()
                t0 = time.perf_counter()
                r.step(tokens)
                t1 = time.perf_counter()
                r.opt_step()
                dist.barrier()
                fb += t1 - t0
                opt += time.perf_counter() - t1
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        report.append(
            f"== {r.name}: forward+backward {1e3 * fb / steps:.0f} ms/step, optimizer "
            f"{1e3 * opt / steps:.0f} ms/step (profiled, {steps} steps)\n{table}"
        )
    return "\n".join(report)


def main() -> None:
    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--case", default="MoE 16 experts")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None, help="also write the report to OUT/profile_engine.txt")
    args = p.parse_args()
    text = run_processes(
        worker, args.world, args.case, args.steps, args.top, args.quick, timeout=1200
    )[0]
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_engine.txt").write_text(text)


if __name__ == "__main__":
    main()
