"""Soak run: the demo model trains 2,000 steps at world size 4 under ``torchrun --max-restarts``,
checkpointing every 100 steps, while a random rank is SIGKILLed about every 500 steps; the final
parameters and optimizer state must equal an uninterrupted run's bit for bit, and live memory
must stay flat. ``nox -s soak`` (not in CI: about an hour on 2 cores).

    python benchmarks/soak.py --out results            # the full run
    python benchmarks/soak.py --steps 300 --every 50 --kill-every 120 --out /tmp/soak  # short

Both runs use the same script (``benchmarks/soak_train.py``), data and seeds; the kills (step and
rank) are drawn from ``--seed``. Writes ``soak.md`` and ``soak.json`` into ``--out`` and exits
non-zero when the states differ or memory grows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

SCRIPT = Path(__file__).with_name("soak_train.py")


def _kills(steps: int, every: int, world: int, seed: int) -> list[tuple[int, int]]:
    """About one kill per ``every`` steps: near each multiple of ``every`` (within a fifth of
    it either side), a random rank; none in the last fifth of an interval before the end."""
    rng = random.Random(seed)
    kills = []
    for center in range(every, steps, every):
        step = center + rng.randint(-every // 5, every // 5)
        if step < steps - every // 5:
            kills.append((step, rng.randrange(world)))
    return kills


def _torchrun(
    workdir: Path, name: str, args: argparse.Namespace, kills: list[tuple[int, int]]
) -> tuple[dict[str, Any], float]:
    """One job; returns (rank 0's result, wall seconds)."""
    run = workdir / name
    out = run / "result.pt"
    if args.analyze:  # a finished run: read what it left
        return torch.load(out), float((run / "wall_s").read_text())
    run.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.world),
        "--max-restarts",
        str(len(kills) + 1),
        "--monitor-interval",
        "0.5",
        str(SCRIPT),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--ckpt",
        str(run / "ckpt"),
        "--out",
        str(out),
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
    ]
    if kills:
        cmd += ["--kills", ",".join(f"{s}:{r}" for s, r in kills)]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        # a fresh rendezvous store per attempt: torchrun's shared agent store otherwise keeps
        # the dead attempt's gloo addresses (see fsdp-engine's engine_reliability_train.py)
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    start = time.monotonic()
    with (run / "torchrun.log").open("w") as log:
        code = subprocess.run(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=False, timeout=args.limit
        ).returncode
    wall = time.monotonic() - start
    (run / "wall_s").write_text(str(wall))
    if code != 0 or not out.exists():
        tail = (run / "torchrun.log").read_text()[-4000:]
        raise SystemExit(f"{name}: torchrun exited {code}\n{tail}")
    return torch.load(out), wall


def _memory(run: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(run.glob("memory-rank*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records


def _flat(records: list[dict[str, Any]], key: str, after: int) -> dict[int, tuple[int, int]]:
    """Per rank: (min, max) of ``key`` over the measured steps after step ``after``."""
    out: dict[int, tuple[int, int]] = {}
    for rank in sorted({r["rank"] for r in records}):
        values = [r[key] for r in records if r["rank"] == rank and r["step"] > after]
        out[rank] = (min(values), max(values))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100, help="checkpoint interval")
    parser.add_argument("--kill-every", type=int, default=500)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--model", default="tiny", help="a preset of examples/llama.py")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per rank")
    parser.add_argument("--seed", type=int, default=14)
    parser.add_argument("--limit", type=float, default=4 * 3600.0, help="seconds per job")
    parser.add_argument("--workdir", default="", help="default: <out>/soak-work")
    parser.add_argument("--out", default="results")
    parser.add_argument("--analyze", action="store_true", help="only summarize a finished run")
    args = parser.parse_args()
    out = Path(args.out)
    workdir = Path(args.workdir) if args.workdir else out / "soak-work"
    if workdir.exists() and not args.analyze:
        raise SystemExit(f"{workdir} exists: remove it (or pass --workdir) for a fresh run")
    kills = _kills(args.steps, args.kill_every, args.world, args.seed)

    straight, straight_s = _torchrun(workdir, "straight", args, [])
    killed, killed_s = _torchrun(workdir, "killed", args, kills)
    happened = [json.loads(p.read_text()) for p in (workdir / "killed").glob("killed-*")]
    happened.sort(key=lambda k: k["step"])
    want, got = straight["state"], killed["state"]
    same_keys = sorted(want) == sorted(got)
    differing = [k for k in want if k not in got or not torch.equal(got[k], want[k])]
    equal = same_keys and not differing
    memory = {name: _memory(workdir / name) for name in ("straight", "killed")}
    settle = 2 * args.every  # the first measured steps include the lazy allocations
    live = {name: _flat(records, "live_bytes", settle) for name, records in memory.items()}
    peak = {name: _flat(records, "peak_bytes", settle) for name, records in memory.items()}
    rss = {name: _flat(records, "rss_bytes", settle) for name, records in memory.items()}
    live_flat = all(lo == hi for ranks in live.values() for lo, hi in ranks.values())
    same_live = live["straight"] == live["killed"]
    summary = {
        "steps": args.steps,
        "world": args.world,
        "model": args.model,
        "checkpoint_every": args.every,
        "kills_planned": kills,
        "kills": happened,
        "restarts": killed["attempt"],
        "resumed_at": killed["resumed_at"],
        "straight_wall_s": straight_s,
        "killed_wall_s": killed_s,
        "tensors_compared": len(want),
        "bitwise_equal": equal,
        "differing": differing[:20],
        "live_bytes": {n: {str(r): v for r, v in d.items()} for n, d in live.items()},
        "peak_bytes": {n: {str(r): v for r, v in d.items()} for n, d in peak.items()},
        "rss_bytes": {n: {str(r): v for r, v in d.items()} for n, d in rss.items()},
        "live_flat": live_flat and same_live,
        "commit": _commit(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": os.getloadavg(),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(summary, indent=1))
    (out / "soak.md").write_text(_markdown(summary))
    print(_markdown(summary))
    if not (equal and live_flat and same_live):
        raise SystemExit("soak: FAILED (see soak.md)")


def _mib(value: int) -> str:
    return f"{value / 2**20:.2f}"


def _markdown(s: dict[str, Any]) -> str:
    def spread(table: dict[str, tuple[int, int]]) -> str:
        lows = [lo for lo, _ in table.values()]
        highs = [hi for _, hi in table.values()]
        return f"{_mib(min(lows))}-{_mib(max(highs))} MiB"

    kills = "; ".join(f"rank {k['rank']} at step {k['step']}" for k in s["kills"]) or "none"
    lines = [
        f"# Soak run ({s['when']}, commit {s['commit']}, load {s['load'][0]:.2f})",
        "",
        f"- {s['steps']} steps of the demo model ({s['model']}) at world size {s['world']} "
        f"(gloo), a checkpoint every {s['checkpoint_every']} steps, under torchrun.",
        f"- SIGKILLs: {kills}; torchrun restarted the job {s['restarts']} times (the last "
        f"attempt resumed at step {s['resumed_at']}).",
        f"- Final state vs the uninterrupted run: {s['tensors_compared']} tensors (parameters "
        f"and AdamW state), bitwise equal: **{s['bitwise_equal']}**"
        + (f" (differing: {s['differing']})" if s["differing"] else "")
        + ".",
        f"- Live storage after a step (dbuffer.testing.LiveBytes, every checkpoint step after step "
        f"{2 * s['checkpoint_every']}, per rank): uninterrupted "
        f"{spread(s['live_bytes']['straight'])}, with kills {spread(s['live_bytes']['killed'])}"
        f"; flat and equal in both: **{s['live_flat']}**. Peak within a step: "
        f"{spread(s['peak_bytes']['killed'])}; RSS {spread(s['rss_bytes']['killed'])}.",
        f"- Wall time: uninterrupted {s['straight_wall_s'] / 60:.1f} min, with kills "
        f"{s['killed_wall_s'] / 60:.1f} min.",
        "",
    ]
    return "\n".join(lines)


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).parent,
        )
        return done.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


if __name__ == "__main__":
    main()
