"""The training job of the soak run (``benchmarks/soak.py``), launched by torchrun.

The demo model (``examples/demo.py``'s ``build``: the LLaMA-like model of ``examples/llama.py``,
one ``fully_shard`` per layer and one at the root, AdamW) trains ``--steps`` steps; every
``--every`` steps all ranks save a committed checkpoint; at start the job resumes from
``latest_checkpoint(--ckpt)``. Each step's batches come from a generator seeded by (step, rank),
so a resumed run sees exactly the data an uninterrupted one does.

``--kills STEP:RANK,...``: when rank RANK starts step STEP (and that kill has not happened yet:
a marker file per kill, so a restarted job replaying the step does not kill again), it starts a
timer that SIGKILLs the process a random fraction of a step later: in the step's compute, a
collective, or the checkpoint save that follows it. torchrun (``--max-restarts``) restarts the
job. At every checkpoint step each rank also measures live memory over one step with
``dbuffer.testing.LiveBytes`` (storage bytes live after the step, and the step's peak) and its
RSS, and appends them to ``memory-rank<r>.jsonl`` next to ``--ckpt`` (kept across kills). Rank
0 writes the final parameters and optimizer state to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
import torch.distributed as dist
from demo import build
from llama import get_batch, load_corpus, loss_fn
from run_tools import persistent_tensors
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from dbuffer.testing import LiveBytes
from fsdp_engine import latest_checkpoint, load_checkpoint, save_checkpoint


def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer-state tensor, full, by name (collective)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    out: dict[str, torch.Tensor] = {}
    for key, value in model_sd.items():
        out[f"model.{key}"] = _full(value)
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim.{fqn}.{key}"] = _full(value)
    return out


def _full(value: torch.Tensor) -> torch.Tensor:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _arm_kill(args: argparse.Namespace, step: int, rank: int, seconds_per_step: float) -> None:
    for index, kill in enumerate(args.kills):
        kill_step, kill_rank = kill
        marker = Path(args.ckpt).parent / f"killed-{index}"
        if kill_step != step or kill_rank != rank or marker.exists():
            continue
        delay = random.Random(index).uniform(0.0, 1.5) * seconds_per_step
        marker.write_text(json.dumps({"step": step, "rank": rank, "delay_s": delay}))
        timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))
        timer.daemon = True
        timer.start()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kills", default="", help="STEP:RANK,...")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--pg-timeout", type=float, default=300.0)
    args = parser.parse_args()
    args.kills = [tuple(int(v) for v in k.split(":")) for k in args.kills.split(",") if k]
    demo_args = argparse.Namespace(
        model=args.model,
        seq_len=0,
        seed=0,
        engine="ours",
        optimizer="adamw",
        mixed_precision="none",
        lr=3e-3,
    )

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    model, opt = build(demo_args, corpus, mesh, torch.device("cpu"))
    seq = model.cfg.seq  # type: ignore[union-attr]
    start = 0
    path = latest_checkpoint(args.ckpt)
    if path is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        info = load_checkpoint(state, path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(info["metadata"]["step"])
    step_times: list[float] = []
    began = time.perf_counter()
    for step in range(start, args.steps):
        seconds = sorted(step_times[-20:])[len(step_times[-20:]) // 2] if step_times else 0.2
        _arm_kill(args, step, rank, seconds)
        gen = torch.Generator().manual_seed(1_000_003 * step + rank)
        tokens = get_batch(corpus.train, gen, args.batch_size, seq)
        measure = (step + 1) % args.every == 0
        t0 = time.perf_counter()
        if measure:
            with LiveBytes(seed=persistent_tensors(model, opt)) as live:
                loss_fn(model, tokens).backward()
                opt.step()
                opt.zero_grad()
            record = {
                "step": step + 1,
                "rank": rank,
                "attempt": attempt,
                "live_bytes": live.current,
                "peak_bytes": live.peak,
                "rss_bytes": _rss_bytes(),
            }
            with (Path(args.ckpt).parent / f"memory-rank{rank}.jsonl").open("a") as fh:
                fh.write(json.dumps(record) + "\n")  # survives a kill of this attempt
        else:
            loss_fn(model, tokens).backward()
            opt.step()
            opt.zero_grad()
        step_times.append(time.perf_counter() - t0)
        if (step + 1) % args.every == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            save_checkpoint(
                {"model": model_sd, "optim": optim_sd},
                Path(args.ckpt) / f"step_{step + 1:08d}",
                metadata={"step": step + 1},
            )
    wall = time.perf_counter() - began
    snapshot = _snapshot(model, opt)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"step_times": step_times})
    if rank == 0:
        result = {
            "state": snapshot,
            "attempt": attempt,
            "resumed_at": start,
            "wall_s": wall,
            "ranks": gathered,
        }
        torch.save(result, args.out)
    dist.barrier()
    # gloo's teardown in torch 2.13 intermittently aborts the process at exit after a restart
    # ("terminate called without an active exception"); the work is done and saved to --out
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
