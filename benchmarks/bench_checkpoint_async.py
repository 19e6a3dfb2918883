"""What an asynchronous checkpoint costs the training step, ours beside torch FSDP2's.

The demo's medium model (``examples/llama.py`` "medium", AdamW state included) at world size 2
on gloo, one thread per rank. Both engines train their own copy in the same processes (ours:
``fsdp_engine.fully_shard`` + ``FlatAdamW``, the demo's; FSDP2: ``torch.distributed.fsdp`` +
``torch.optim.AdamW``). The time is cut into windows of ``--window`` training steps; a window
either saves once, between its first two steps, or does not, and the windows alternate (the
order reversed every round). Save kinds:

- ours ``async_save_checkpoint`` (committed atomically, digests computed by the writer thread);
- FSDP2 + ``dcp.async_save`` (the peer; on a gloo group of its own, as DCP asks);
- ours + ``dcp.async_save`` (the same call on our state dict);
- ours ``save_checkpoint`` (synchronous, for scale).

Per save: the *stall*, the time the training thread spends in the save call (checks and the
copy to CPU memory), and the *cost*, the window's time minus the paired no-save window's of the
same engine in the same round (the stall plus every step the writer thread slowed down: on
this CPU machine it competes with training for the cores), both as a share of the engine's
median step; medians and minimums over the rounds. The writer's own time (call to commit) and
whether it finished inside its window are recorded. Rank 0's clock, between barriers.

    python benchmarks/bench_checkpoint_async.py                        # ~15 min on 2 cores
    python benchmarks/bench_checkpoint_async.py --from-json --readme packages/fsdp-engine/README.md

Writes ``bench_checkpoint_async.md`` / ``.json`` into ``--out``; ``--readme`` replaces the table
between the ``checkpoint_async`` markers of that README.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import torch
import torch.distributed as dist

MARK = "checkpoint_async"
KINDS = {  # kind -> (engine, what the window does)
    "ours, no save": ("fsdp-engine", None),
    "ours, async_save_checkpoint": ("fsdp-engine", "ours"),
    "ours, dcp.async_save": ("fsdp-engine", "dcp"),
    "ours, save_checkpoint (sync)": ("fsdp-engine", "sync"),
    "FSDP2, no save": ("fsdp2", None),
    "FSDP2, dcp.async_save": ("fsdp2", "dcp"),
}
BASELINE = {"fsdp-engine": "ours, no save", "fsdp2": "FSDP2, no save"}


def _build(engine: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from demo import build
    from llama import load_corpus
    from torch.distributed.device_mesh import init_device_mesh

    args = argparse.Namespace(
        model="medium", seq_len=0, seed=0, engine=engine, optimizer="adamw",
        mixed_precision="none", lr=3e-3,
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    return build(args, load_corpus(), mesh, torch.device("cpu"))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    from llama import get_batch, load_corpus, loss_fn

    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = get_batch(load_corpus().train, gen, 8, model.cfg.seq)  # type: ignore[union-attr]
    loss_fn(model, tokens).backward()
    opt.step()
    opt.zero_grad()


def _start_save(
    how: str, model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path, group: Any
) -> Any:
    """Start one save; returns what to wait on (``None``: it already finished)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fsdp_engine import async_save_checkpoint, save_checkpoint

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    if how == "ours":
        return async_save_checkpoint(state, path)
    if how == "dcp":
        return dcp.async_save(state, checkpoint_id=str(path), process_group=group)
    save_checkpoint(state, path)
    return None


def worker(rank: int, world: int, rounds: int, window: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    group = dist.new_group(backend="gloo")  # dcp.async_save's thread: not the training group
    models = {engine: _build(engine, world) for engine in BASELINE}
    counters = dict.fromkeys(BASELINE, 0)
    for engine, (model, opt) in models.items():
        for _ in range(warmup):
            _step(model, opt, counters[engine], rank)
            counters[engine] += 1
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_async_")) if rank == 0 else None
    root = Path(_shared(str(root) if root else None))
    rows: dict[str, dict[str, list[Any]]] = {
        kind: {"window": [], "cpu": [], "steps": [], "stall": [], "writer": [], "in_window": []}
        for kind in KINDS
    }
    order = list(KINDS)
    for index in range(rounds):
        for kind in order if index % 2 == 0 else order[::-1]:
            engine, how = KINDS[kind]
            model, opt = models[engine]
            path = root / f"r{index}_{kind.split(',')[0]}_{how}"
            pending: Any = None
            steps = []
            dist.barrier()
            t0, cpu0 = time.perf_counter(), time.process_time()
            for j in range(window):
                s0 = time.perf_counter()
                _step(model, opt, counters[engine], rank)
                counters[engine] += 1
                steps.append(time.perf_counter() - s0)
                if j == 0 and how is not None:
                    c0 = time.perf_counter()
                    pending = _start_save(how, model, opt, path, group)
                    rows[kind]["stall"].append(time.perf_counter() - c0)
            dist.barrier()
            rows[kind]["window"].append(time.perf_counter() - t0)
            rows[kind]["steps"].append(steps)
            if how is not None:
                rows[kind]["in_window"].append(pending is None or pending.done())
                if pending is not None:
                    pending.result()
                rows[kind]["writer"].append(time.perf_counter() - t0 - steps[0])
            # the process's CPU time (every thread: training, the writer, gloo's), writer done
            rows[kind]["cpu"].append(time.process_time() - cpu0)
            dist.barrier()
        if rank == 0:
            for child in root.iterdir():
                if child.is_dir():
                    shutil.rmtree(child)
                else:
                    child.unlink()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def _shared(value: str | None) -> str:
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])


def summarize(rows: dict[str, dict[str, list[Any]]], window: int) -> dict[str, Any]:
    """Per kind: the median step (no-save windows), and per save the stall and the cost against
    the paired no-save window of the same round, as shares of that median step."""
    out: dict[str, Any] = {}
    for kind, (engine, how) in KINDS.items():
        r = rows[kind]
        base = rows[BASELINE[engine]]
        step = statistics.median(s for steps in base["steps"] for s in steps)
        entry: dict[str, Any] = {"engine": engine, "step_s": step}
        if how is not None:
            costs = [w - b for w, b in zip(r["window"], base["window"], strict=True)]
            cpu = [w - b for w, b in zip(r["cpu"], base["cpu"], strict=True)]
            entry.update(
                stall_s=statistics.median(r["stall"]),
                stall_min_s=min(r["stall"]),
                stall_share=statistics.median(r["stall"]) / step,
                stall_min_share=min(r["stall"]) / step,
                cost_s=statistics.median(costs),
                cost_min_s=min(costs),
                cost_share=statistics.median(costs) / step,
                cost_min_share=min(costs) / step,
                cpu_s=statistics.median(cpu),
                cpu_share=statistics.median(cpu) / statistics.median(base["cpu"]) * window,
                writer_s=statistics.median(r["writer"]),
                in_window=f"{sum(r['in_window'])}/{len(r['in_window'])}",
                saves=len(r["stall"]),
            )
        out[kind] = entry
    return out


def markdown(data: dict[str, Any]) -> str:
    a, s = data["args"], data["summary"]
    lines = [
        f"{data['info']}; demo medium model + AdamW state, world size 2, gloo, fp32, one thread "
        f"per rank; {a['rounds']} rounds of windows of {a['window']} steps (one save per saving "
        f"window), kinds alternating, order reversed every round; {data['checkpoint_mib']:.1f} "
        "MiB per checkpoint. `python benchmarks/bench_checkpoint_async.py`. Stall: the training "
        "thread inside the save call; cost: the window minus the paired no-save window of the "
        "same engine (stall + the steps the writer thread slowed); both per save, as a share of "
        "the engine's median step; median (min).",
        "",
        "| save | median step | stall per save | stall / step | cost per save | cost / step "
        "| CPU per save (rank 0) | writer, call to commit | done within its window |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, e in s.items():
        if "stall_s" not in e:
            continue
        lines.append(
            f"| {kind} | {e['step_s']:.3f} s | {1e3 * e['stall_s']:.1f} ms "
            f"({1e3 * e['stall_min_s']:.1f}) | {100 * e['stall_share']:.1f}% "
            f"({100 * e['stall_min_share']:.1f}%) | {1e3 * e['cost_s']:.0f} ms "
            f"({1e3 * e['cost_min_s']:.0f}) | {100 * e['cost_share']:+.1f}% "
            f"({100 * e['cost_min_share']:+.1f}%) | {1e3 * e['cpu_s']:.0f} ms "
            f"({100 * e['cpu_share']:.0f}% of a step's) | {e['writer_s']:.2f} s | "
            f"{e['in_window']} |"
        )
    return "\n".join(lines)


def write_readme(path: Path, section: str) -> None:
    text = path.read_text()
    begin = f"<!-- generated: {MARK} (benchmarks/bench_checkpoint_async.py --readme) -->"
    end = f"<!-- end generated: {MARK} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: markers {begin!r} ... {end!r} not found")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{section}\n{end}", text))


def _checkpoint_mib(world: int) -> float:
    """The size of one checkpoint of ours (written once, outside the timing)."""
    from ragged_dtensor.testing import run_processes

    with tempfile.TemporaryDirectory() as root:
        return float(run_processes(_size_worker, world, root, timeout=600)[0])


def _size_worker(rank: int, world: int, root: str) -> float:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from fsdp_engine import checkpoint_info, save_checkpoint

    torch.set_num_threads(1)
    model, opt = _build("fsdp-engine", world)
    _step(model, opt, 0, rank)
    model_sd, optim_sd = get_state_dict(model, opt)
    path = save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "one")
    files = checkpoint_info(path)["files"]
    return sum(f["size"] for f in files.values()) / 2**20


def main(argv: list[str] | None = None) -> None:
    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--window", type=int, default=3, help="training steps per window")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=3600.0)
    p.add_argument("--from-json", action="store_true", help="reuse --out's JSON, run nothing")
    p.add_argument("--readme", default=None, help="README whose marked table to write")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        data = json.loads((out / "bench_checkpoint_async.json").read_text())
    else:
        start = time.perf_counter()
        rows = run_processes(
            worker, 2, args.rounds, args.window, args.warmup, timeout=args.timeout
        )[0]
        load = "?"
        with contextlib.suppress(OSError):
            load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        data = {
            "args": {"rounds": args.rounds, "window": args.window, "warmup": args.warmup},
            "info": (
                f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} CPUs, torch "
                f"{torch.__version__}, load average at the end {load}"
            ),
            "checkpoint_mib": _checkpoint_mib(2),
            "rows": rows,
            "summary": summarize(rows, args.window),
            "seconds": time.perf_counter() - start,
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_checkpoint_async.json").write_text(json.dumps(data, indent=1) + "\n")
        (out / "bench_checkpoint_async.md").write_text(markdown(data) + "\n")
    print(markdown(data))
    if args.readme:
        write_readme(Path(args.readme), markdown(data))
        print(f"wrote the {MARK} table of {args.readme}")


if __name__ == "__main__":
    main()
