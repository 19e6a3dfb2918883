"""What an asynchronous checkpoint costs the training step, ours beside torch FSDP2's.

The demo's medium model (``examples/llama.py`` "medium", AdamW state included) at world size 2
on gloo, one thread per rank. Both engines train their own copy in the same processes (ours:
``fsdp_engine.fully_shard`` + ``optim_blockwise.FlatAdamW``, the demo's; FSDP2:
``torch.distributed.fsdp`` + ``torch.optim.AdamW``). Save kinds:

- ours ``async_save_checkpoint`` (committed atomically, digests computed by the writer thread);
- FSDP2 + ``dcp.async_save`` (the peer; on a gloo group of its own, as DCP asks);
- ours + ``dcp.async_save`` (the same call on our state dict);
- ours ``save_checkpoint`` (synchronous, for scale).

Each round runs, for every kind, a pair of adjacent windows of ``--window`` training steps of
that kind's engine: one saves once (between its first two steps), the other does not; the
order within pairs and of the kinds flips every round. Per save:

- the *stall*: the training thread's wall time inside the save call (checks, the copy to CPU
  memory, for ``save_checkpoint`` the whole save), and its CPU time there;
- the *background CPU*: the CPU time of the thread that writes (our writer thread, DCP's
  executor thread: the time inside DCP's ``save`` / our ``write``), which the training thread
  no longer pays; on a machine whose cores training keeps busy it competes for them;
- the *window cost*: the save window minus its paired no-save window (the stall plus every
  step the background work slowed down), which on a shared, oversubscribed machine is mostly
  noise: read it with its minimum.

Shares are of the engine's median step (wall) or median step CPU; medians and minimums over the
rounds; rank 0's clocks, windows between barriers.

    python benchmarks/bench_checkpoint_async.py                        # ~10 min on 2 cores
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

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

MARK = "checkpoint_async"
KINDS = {  # save kind -> (engine, how it saves)
    "ours, async_save_checkpoint": ("fsdp-engine", "ours"),
    "FSDP2, dcp.async_save": ("fsdp2", "dcp"),
    "ours, dcp.async_save": ("fsdp-engine", "dcp"),
    "ours, save_checkpoint (sync)": ("fsdp-engine", "sync"),
}
SAVES = list(KINDS)
BASELINE = ("fsdp-engine", "fsdp2")


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


def _timed(module: Any, name: str, into: list[float]) -> None:
    """Record the calling thread's CPU time in ``module.name`` (the background write)."""
    real = getattr(module, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.thread_time()
        try:
            return real(*args, **kwargs)
        finally:
            into.append(time.thread_time() - start)

    setattr(module, name, timed)


def worker(rank: int, world: int, rounds: int, window: int, warmup: int) -> dict[str, Any]:
    import torch.distributed.checkpoint.state_dict_saver as dcp_saver

    from fsdp_engine._private import checkpoint_save

    torch.set_num_threads(1)
    background: list[float] = []
    _timed(checkpoint_save, "write", background)  # ours: the writer thread (sync: this one)
    _timed(dcp_saver, "save", background)  # dcp.async_save's executor thread imports it there
    group = dist.new_group(backend="gloo")  # dcp.async_save's thread: not the training group
    models = {engine: _build(engine, world) for engine in BASELINE}
    counters = dict.fromkeys(BASELINE, 0)
    for engine, (model, opt) in models.items():
        for _ in range(warmup):
            _step(model, opt, counters[engine], rank)
            counters[engine] += 1
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_async_")) if rank == 0 else None
    root = Path(_shared(str(root) if root else None))
    fields = ("window", "base", "steps", "step_cpu", "stall", "stall_cpu", "background")
    rows: dict[str, dict[str, list[Any]]] = {
        kind: {f: [] for f in (*fields, "writer", "in_window")} for kind in SAVES
    }
    for index in range(rounds):
        for kind in SAVES if index % 2 == 0 else SAVES[::-1]:
            engine, how = KINDS[kind]
            model, opt = models[engine]
            for saving in (False, True) if index % 2 == 0 else (True, False):
                path = root / f"r{index}_{kind.split(',')[0]}_{how}"
                pending: Any = None
                steps, step_cpu = [], []
                background.clear()
                dist.barrier()
                t0 = time.perf_counter()
                for j in range(window):
                    s0, c0 = time.perf_counter(), time.thread_time()
                    _step(model, opt, counters[engine], rank)
                    counters[engine] += 1
                    steps.append(time.perf_counter() - s0)
                    step_cpu.append(time.thread_time() - c0)
                    if j == 0 and saving:
                        c0, cpu0 = time.perf_counter(), time.thread_time()
                        pending = _start_save(how, model, opt, path, group)
                        rows[kind]["stall"].append(time.perf_counter() - c0)
                        rows[kind]["stall_cpu"].append(time.thread_time() - cpu0)
                dist.barrier()
                elapsed = time.perf_counter() - t0
                if not saving:
                    rows[kind]["base"].append(elapsed)
                    rows[kind]["steps"].append(steps)
                    rows[kind]["step_cpu"].append(step_cpu)
                    continue
                rows[kind]["window"].append(elapsed)
                rows[kind]["in_window"].append(pending is None or pending.done())
                if pending is not None:
                    pending.result()
                rows[kind]["writer"].append(time.perf_counter() - t0 - steps[0])
                # the background thread's CPU (a synchronous save's write is the stall's)
                rows[kind]["background"].append(0.0 if how == "sync" else sum(background))
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


def summarize(rows: dict[str, dict[str, list[Any]]]) -> dict[str, Any]:
    """Per save kind: the engine's median step (its no-save windows), the stall, the background
    CPU and the paired window cost, medians and minimums, also as shares of a step."""
    out: dict[str, Any] = {}
    for kind in SAVES:
        engine = KINDS[kind][0]
        r = rows[kind]
        step = statistics.median(
            s for k in SAVES if KINDS[k][0] == engine for steps in rows[k]["steps"] for s in steps
        )
        step_cpu = statistics.median(
            s for k in SAVES if KINDS[k][0] == engine for cpu in rows[k]["step_cpu"] for s in cpu
        )
        costs = [w - b for w, b in zip(r["window"], r["base"], strict=True)]
        out[kind] = {
            "engine": engine,
            "step_s": step,
            "step_cpu_s": step_cpu,
            "stall_s": statistics.median(r["stall"]),
            "stall_min_s": min(r["stall"]),
            "stall_share": statistics.median(r["stall"]) / step,
            "stall_min_share": min(r["stall"]) / step,
            "stall_cpu_s": statistics.median(r["stall_cpu"]),
            "stall_cpu_share": statistics.median(r["stall_cpu"]) / step_cpu,
            "background_cpu_s": statistics.median(r["background"]),
            "background_cpu_share": statistics.median(r["background"]) / step_cpu,
            "cost_s": statistics.median(costs),
            "cost_min_s": min(costs),
            "cost_share": statistics.median(costs) / step,
            "cost_min_share": min(costs) / step,
            "writer_s": statistics.median(r["writer"]),
            "in_window": f"{sum(r['in_window'])}/{len(r['in_window'])}",
            "saves": len(r["stall"]),
        }
    return out


def markdown(data: dict[str, Any]) -> str:
    a, s = data["args"], data["summary"]
    lines = [
        f"{data['info']}; demo medium model + AdamW state, world size 2, gloo, fp32, one thread "
        f"per rank; {data['checkpoint_mib']:.1f} MiB per checkpoint; {a['rounds']} rounds, each a "
        f"pair of adjacent windows of {a['window']} steps (one save, no save) per kind, orders "
        "flipped every round. `python benchmarks/bench_checkpoint_async.py`. Stall: the training "
        "thread inside the save call, wall and CPU; background CPU: the thread that writes; "
        "window cost: the save window minus its paired no-save window; per save, as shares of "
        "the engine's median step (wall, or CPU for CPU times); median (min).",
        "",
        "| save | median step | stall | stall / step | stall CPU / step CPU | background CPU "
        "/ step CPU | window cost / step | writer: call to commit |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind, e in s.items():
        background = (
            "- (in the stall)"
            if KINDS[kind][1] == "sync"
            else f"{1e3 * e['background_cpu_s']:.0f} ms: {100 * e['background_cpu_share']:.0f}%"
        )
        lines.append(
            f"| {kind} | {e['step_s']:.3f} s | {1e3 * e['stall_s']:.1f} ms "
            f"({1e3 * e['stall_min_s']:.1f}) | **{100 * e['stall_share']:.1f}%** "
            f"({100 * e['stall_min_share']:.1f}%) | {100 * e['stall_cpu_share']:.1f}% | "
            f"{background} | {100 * e['cost_share']:+.0f}% ({100 * e['cost_min_share']:+.0f}%) "
            f"| {e['writer_s']:.2f} s ({e['in_window']} within the window) |"
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
            "summary": summarize(rows),
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
