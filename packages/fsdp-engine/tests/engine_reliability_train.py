"""A training script for torchrun that checkpoints, resumes, and can kill one of its ranks.

    python -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts 1 \\
        engine_reliability_train.py --steps 8 --every 3 --ckpt DIR --out FILE \\
        [--kill-rank 1 --kill-at 7 --kill-marker FILE] [--async-save [--kill-in-save 6]]

Every ``--every`` steps all ranks save a committed checkpoint (``save_checkpoint``, or
``async_save_checkpoint`` with ``--async-save``: training goes on while the writer thread
writes); at start the script resumes from ``latest_checkpoint(DIR)`` when there is one. With
``--kill-at J`` rank ``--kill-rank`` SIGKILLs itself in the middle of step J (after its backward,
before the optimizer step); with ``--kill-in-save J`` its writer thread SIGKILLs the process in
the asynchronous save of step J, after writing that rank's files and before the commit, while
the training thread is already in the next steps. Either happens on the first attempt only: the
marker file and ``TORCHELASTIC_RESTART_COUNT`` keep the restarted job from killing again. Rank 0
writes the final parameters and optimizer state to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from engine_models import batches, loss_fn
from engine_reliability_common import GLOBAL_BATCHES, build, full_snapshot
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from fsdp_engine import (
    AsyncSaveHandle,
    async_save_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from fsdp_engine._private import checkpoint_files


def _kill_in_save(step: int, rank: int, marker: Path) -> None:
    """The writer of the save of ``step`` on ``rank`` SIGKILLs its process once its files are
    on disk (the other ranks' writers wait for its digests; no marker is written)."""
    target = f"step_{step:08d}"

    class KillingWriter(checkpoint_files.DigestingWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)
            future.wait()
            if target in str(self.path) and dist.get_rank() == rank and not marker.exists():
                marker.write_text(f"rank {rank} killed itself in the save of {target}\n")
                os.kill(os.getpid(), signal.SIGKILL)
            return future

    checkpoint_files.DigestingWriter = KillingWriter  # type: ignore[misc]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kill-rank", type=int, default=1)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--kill-marker", default="")
    parser.add_argument("--pg-timeout", type=float, default=60.0)
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--kill-in-save", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (the test does): with torchrun's shared
    # agent store, the keys of the killed attempt's process group (each rank's gloo address)
    # survive the restart, and a restarted rank can read its dead peer's address before the new
    # peer overwrites it (gloo: "Connection refused"). Keying the group by attempt on our own
    # TCPStore client avoided that but aborted some runs at exit ("terminate called without an
    # active exception").
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.kill_in_save and attempt == 0 and args.kill_marker:
        _kill_in_save(args.kill_in_save, args.kill_rank, Path(args.kill_marker))
    model, opt = build(world)
    pending: AsyncSaveHandle | None = None
    start = 0
    resumed_from = None
    path = latest_checkpoint(args.ckpt)
    if path is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        info = load_checkpoint(state, path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = int(info["metadata"]["step"])
        resumed_from = path.name
    data = batches(args.steps, 1, batch=GLOBAL_BATCHES)
    for step in range(start, args.steps):
        loss_fn(model, data[step].chunk(world)[rank]).backward()
        marker = Path(args.kill_marker) if args.kill_marker else None
        if (
            step + 1 == args.kill_at
            and rank == args.kill_rank
            and attempt == 0
            and marker is not None
            and not marker.exists()
        ):
            marker.write_text(f"rank {rank} killed itself in step {step + 1}\n")
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        if (step + 1) % args.every == 0:
            model_sd, optim_sd = get_state_dict(model, opt)
            save = async_save_checkpoint if args.async_save else save_checkpoint
            if pending is not None:
                pending.result()  # the previous save's outcome (the next save waits for it)
            outcome = save(
                {"model": model_sd, "optim": optim_sd},
                Path(args.ckpt) / f"step_{step + 1:08d}",
                metadata={"step": step + 1},
            )
            pending = outcome if isinstance(outcome, AsyncSaveHandle) else None
    if pending is not None:
        pending.result()  # before the snapshot's collectives and the exit below
    snapshot = full_snapshot(model, opt)
    if rank == 0:
        result = {"state": snapshot, "attempt": attempt, "resumed_from": resumed_from}
        torch.save(result, args.out)
    dist.barrier()
    # After a restart, gloo's teardown in torch 2.13 intermittently aborts the process at exit
    # ("terminate called without an active exception", SIGABRT) once everything is done, which
    # torchrun reports as a failed job. The work is complete and checked through --out, so the
    # process leaves without running that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
