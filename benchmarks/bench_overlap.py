"""How much communication each engine hides behind compute: ours vs torch FSDP2 on CPU/gloo.

gloo runs an async collective on its own threads, so on CPU communication issued early really
runs while the main thread computes. Per engine, in the same gloo processes, alternating:

- ``T``: a training step (forward, backward, ``optimizer.step()``, ``zero_grad``), barrier-timed;
- ``C``: the same step with every collective skipped (each returns at once, a completed work to
  async callers): the step's compute and host work alone;
- ``M``: the step's collectives alone: every collective the engine issued in one step, recorded
  (function, shapes, dtypes, group, op) and replayed back to back, synchronously, on fresh
  tensors;
- hidden fraction ``(C + M - T) / M`` (from the minimums over the repeats, and from the
  medians): 0 when nothing overlaps (``T = C + M``), 1 when all
  communication hides behind compute (``T = C``). Communication's share of the step is
  ``M / (C + M)``; the model is chosen so that it is at least 30% for both engines.

The model: ``--layers`` blocks (Linear d->d, ReLU; each ``fully_shard``-ed, then the root), SGD,
``--tokens`` rows per rank: wide layers and few rows, so communication weighs.

    python benchmarks/bench_overlap.py [--world 2] [--layers 8] [--dim 1024] [--tokens 64]

Writes ``bench_overlap.md`` / ``.json`` into ``--out`` (default ``results/``).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ("ours", "fsdp2")


class Recorder:
    """Records every collective one step issues, to replay them without compute."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, list[tuple[tuple[int, ...], Any]], dict[str, Any]]] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        def recording(*args: Any, **kwargs: Any) -> Any:
            tensors = [(tuple(a.shape), a.dtype) for a in args if isinstance(a, torch.Tensor)]
            rest = {k: v for k, v in kwargs.items() if k != "async_op"}
            self.calls.append((name, tensors, rest))
            return fn(*args, **kwargs)

        return recording

    def replay(self) -> Callable[[], None]:
        """A function issuing the recorded collectives synchronously on preallocated tensors."""
        import torch
        import torch.distributed as dist

        prepared = []
        for name, tensors, kwargs in self.calls:
            fn = getattr(dist, name)
            args = [torch.zeros(shape, dtype=dtype) for shape, dtype in tensors]
            prepared.append((fn, args, kwargs))

        def run() -> None:
            for fn, args, kwargs in prepared:
                fn(*args, **kwargs)

        return run


def worker(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from bench_scale_host import COLLECTIVES, CommTimer
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    dim, layers = cfg["dim"], cfg["layers"]
    base = nn.Sequential(*(nn.Sequential(nn.Linear(dim, dim), nn.ReLU()) for _ in range(layers)))
    models, opts = {}, {}
    for engine in ENGINES:
        if engine == "ours":
            from fsdp_engine import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        model = copy.deepcopy(base)
        for block in model:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models[engine], opts[engine] = model, torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(cfg["tokens"], dim, generator=gen)

    def step(engine: str) -> None:
        models[engine](x).sum().backward()
        opts[engine].step()
        opts[engine].zero_grad(set_to_none=True)

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        return time.perf_counter() - t0

    # Record each engine's collectives of one (warm) step.
    replays, counts = {}, {}
    for engine in ENGINES:
        step(engine)
        recorder = Recorder()
        saved = {n: getattr(dist, n) for n in COLLECTIVES if hasattr(dist, n) and n != "barrier"}
        for n, fn in saved.items():
            setattr(dist, n, recorder.wrap(n, fn))
        try:
            step(engine)
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
        replays[engine] = recorder.replay()
        counts[engine] = [name for name, _, _ in recorder.calls]
        replays[engine]()  # warm
    skip = CommTimer(skip=True)
    out: dict[str, Any] = {e: {"T": [], "C": [], "M": []} for e in ENGINES}
    for i in range(cfg["steps"]):
        order = ENGINES if i % 2 == 0 else ENGINES[::-1]
        for engine in order:
            out[engine]["T"].append(timed(lambda e=engine: step(e)))  # type: ignore[misc]
            with skip.installed():
                out[engine]["C"].append(timed(lambda e=engine: step(e)))  # type: ignore[misc]
            out[engine]["M"].append(timed(replays[engine]))
    for engine in ENGINES:
        out[engine]["collectives"] = counts[engine]
    return out


def summarize(res: dict[str, Any]) -> dict[str, dict[str, float]]:
    rows = {}
    for engine in ENGINES:
        t, c, m = (statistics.median(res[engine][k]) for k in ("T", "C", "M"))
        t0, c0, m0 = (min(res[engine][k]) for k in ("T", "C", "M"))
        rows[engine] = {
            "T": t,
            "C": c,
            "M": m,
            "comm_share": m / (c + m),
            "hidden": (c + m - t) / m,
            "T_min": t0,
            "C_min": c0,
            "M_min": m0,
            "comm_share_min": m0 / (c0 + m0),
            "hidden_min": (c0 + m0 - t0) / m0,
        }
    return rows


def markdown(rows: dict[str, dict[str, float]], info: dict[str, str], cfg: dict[str, Any]) -> str:
    lines = [
        f"{info['date']}; {info['cpu']}, {info['nproc']} cores; torch {info['torch']}; gloo, "
        f"world {cfg['world']}, 1 thread per rank; load average at the end {info['load']}; "
        f"commit {info['commit']}.",
        "",
        f"`python benchmarks/bench_overlap.py` — {cfg['layers']} blocks Linear "
        f"{cfg['dim']}->{cfg['dim']} + ReLU, each `fully_shard`-ed + root, SGD, {cfg['tokens']} "
        f"rows per rank; medians of {cfg['steps']} steps per measurement, engines alternating. "
        "T: the step; C: the step with collectives skipped; M: the step's collectives replayed "
        "alone; hidden = (C + M - T) / M, from the minimums of each measurement (the least "
        "disturbed repeat; on a loaded machine the medians carry the waits for a core) and, "
        "in brackets, from the medians.",
        "",
        "| engine | step T ms min (median) | compute-only C ms | comm-only M ms | comm share "
        "M/(C+M) | hidden fraction |",
        "|---|---|---|---|---|---|",
    ]
    for engine in ENGINES:
        r = rows[engine]
        label = "ours (fsdp_engine)" if engine == "ours" else "torch FSDP2"
        lines.append(
            f"| {label} | {1e3 * r['T_min']:.1f} ({1e3 * r['T']:.1f}) | "
            f"{1e3 * r['C_min']:.1f} ({1e3 * r['C']:.1f}) | "
            f"{1e3 * r['M_min']:.1f} ({1e3 * r['M']:.1f}) | "
            f"{100 * r['comm_share_min']:.0f}% ({100 * r['comm_share']:.0f}%) | "
            f"{100 * r['hidden_min']:.0f}% ({100 * r['hidden']:.0f}%) |"
        )
    ratio = rows["ours"]["T_min"] / rows["fsdp2"]["T_min"]
    median = rows["ours"]["T"] / rows["fsdp2"]["T"]
    lines += ["", f"Step time ours / FSDP2: {ratio:.2f}x by the minimums ({median:.2f}x medians)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from bench_scale_host import machine

    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1800.0)
    args = p.parse_args(argv)
    cfg = {k: getattr(args, k) for k in ("world", "layers", "dim", "tokens", "steps")}
    res = run_processes(worker, args.world, cfg, timeout=args.timeout)[0]
    rows = summarize(res)
    info = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, info, cfg)
    (out / "bench_overlap.md").write_text(table)
    (out / "bench_overlap.json").write_text(
        json.dumps({"machine": info, "config": cfg, "rows": rows, "raw": res}, indent=1)
    )
    print(table)


if __name__ == "__main__":
    main()
