"""Host cost of a training step at any world size: ours vs torch FSDP2 under the fake process group.

torch's fake process group (``FakeStore``, backend ``"fake"``) lets one process act as rank 0 of
``m`` ranks: collectives are accepted and complete at once, so what a step costs this process,
planning and bookkeeping included, can be measured at m = 16384 on one machine. Both engines
shard their own copy of the same model (same initial weights, same batch, same optimizer) in one
process per world size and **alternate step by step** (the order flips every step), so machine
load hits both alike.

[Note: what "host time" is here]
The fake backend still does work proportional to the sizes it is handed: its all-gather copies
the input into each of the m chunks of the output and its reduce-scatter walks the m chunks
(measured here: 4 ms per all-gather of one element at m = 1024, 120 ms for 1000 elements at
m = 16384). That is the simulation standing in for the network, not either engine's host work,
and it grows with m for everyone; its m small copies also evict the caches the next kernels
run in. So every ``torch.distributed`` collective entry point is wrapped (both engines call them
through ``torch.distributed.<name>``; the calls are counted per step, so a missed path would
show). By default (``--collectives skip``) the wrapper returns at once (a completed work to async
callers) and the step's wall time is the engines' own host work; with ``--collectives fake`` the
fake backend runs them and their time is subtracted:

    host time = step time - time inside the process group's collectives,

on the main thread's CPU clock (``--clock cpu``, the default on CPU: torch runs one intra-op
thread here, so it is all of the engines' work, and a loaded machine's waits for a core do not
count) or the wall clock (``--clock wall``, the default on CUDA, where the step ends with a
synchronize). Every step's wall and CPU times are in the JSON.

The model: ``--layers`` residual blocks (LayerNorm(64), Linear 64->256,
GELU, Linear 256->64), each block ``fully_shard``-ed, then the root; SGD; a step is forward,
backward, ``optimizer.step()`` and ``zero_grad(set_to_none=True)``. On ``--device cuda`` the
tensors live on the GPU (real kernels and streams, no communication) and each step ends with
``torch.cuda.synchronize()``.

Writes ``bench_scale_host.md`` (table), ``bench_scale_host.json`` (every step) and
``bench_scale_host.png`` (needs matplotlib) into ``--out``; ``--profile`` adds
``bench_scale_host_profile.txt``: cProfile of our steps at the largest world size.

    python benchmarks/bench_scale_host.py                          # m = 8 ... 16384, ~15 min
    python benchmarks/bench_scale_host.py --worlds 8 1024 --steps 5 --layers 8   # quick
    python benchmarks/bench_scale_host.py --device cuda --worlds 8 1024          # on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import io
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

ENGINES = ("ours", "fsdp2")
LABELS = {"ours": "ours (fsdp_engine)", "fsdp2": "torch FSDP2"}
# Every collective entry point either engine may reach (looked up as torch.distributed.<name>
# at call time by both).
COLLECTIVES = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_single",
    "broadcast",
    "barrier",
)


def _completed_work() -> Any:
    import torch
    from torch._C._distributed_c10d import _create_work_from_future

    future: Any = torch.futures.Future()
    future.set_result(None)
    return _create_work_from_future(future)


class CommTimer:
    """Wraps ``torch.distributed``'s collectives: seconds and calls inside them since ``reset``.

    ``skip``: do not call the process group at all (a completed work is returned to async
    callers), so the fake backend's own O(m) work neither costs time nor evicts the caches the
    engines' host work runs in (see [Note: what "host time" is here]).
    """

    def __init__(self, *, skip: bool = False) -> None:
        self.skip = skip
        self.seconds = 0.0  # wall clock
        self.cpu_seconds = 0.0  # this thread's CPU time
        self.calls: dict[str, int] = {}

    def reset(self) -> None:
        self.seconds = self.cpu_seconds = 0.0
        self.calls = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[CommTimer]:
        import torch.distributed as dist

        saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kwargs: Any) -> Any:
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    if self.skip:
                        return _completed_work() if kwargs.get("async_op") else None
                    return fn(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - t0
                    self.cpu_seconds += time.thread_time() - c0
                    self.calls[name] = self.calls.get(name, 0) + 1

            return timed

        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)


def build_model(layers: int, dim: int, hidden: int) -> Any:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            self.up = nn.Linear(dim, hidden)
            self.down = nn.Linear(hidden, dim)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.head = nn.Linear(dim, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Net()


def _shard(engine: str, model: Any, mesh: Any) -> float:
    if engine == "ours":
        from fsdp_engine import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    t0 = time.perf_counter()
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return time.perf_counter() - t0


def child(cfg: dict[str, Any]) -> dict[str, Any]:
    """One world size: both engines in this process, alternating steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(cfg["threads"])
    # Skipped collectives leave gathered buffers uninitialised: no denormal slow paths.
    torch.set_flush_denormal(True)
    m, device = cfg["world"], cfg["device"]
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=m)
    mesh = init_device_mesh(device, (m,))
    torch.manual_seed(0)
    base = build_model(cfg["layers"], cfg["dim"], cfg["hidden"]).to(device)
    models, opts, setup = {}, {}, {}
    for engine in cfg["engines"]:
        models[engine] = copy.deepcopy(base)
        setup[engine] = _shard(engine, models[engine], mesh)
        opts[engine] = torch.optim.SGD(models[engine].parameters(), lr=1e-3)
    x = torch.randn(cfg["batch"], cfg["dim"], generator=torch.Generator().manual_seed(1)).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # Everything made so far (torch, both models, the m-rank mesh) is moved out of the cyclic
    # collector's reach, so a full collection in a timed step costs what the step allocated,
    # not what the process holds (a full pass over it took ~0.5 s here).
    gc.collect()
    gc.freeze()
    timer = CommTimer(skip=cfg["collectives"] == "skip")

    def step(engine: str) -> dict[str, Any]:
        model, opt = models[engine], opts[engine]
        gc.collect()
        sync()
        timer.reset()
        faults = _minor_faults()
        t0, c0 = time.perf_counter(), time.thread_time()
        model(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return {
            "wall": time.perf_counter() - t0,
            "cpu": time.thread_time() - c0,
            "page_faults": _minor_faults() - faults,
            "comm": timer.seconds,
            "comm_cpu": timer.cpu_seconds,
            "calls": dict(timer.calls),
        }

    out: dict[str, Any] = {
        "world": m,
        "setup_s": setup,
        "steps": {e: [] for e in cfg["engines"]},
    }
    with timer.installed():
        for _ in range(cfg["warmup"]):
            for engine in cfg["engines"]:
                step(engine)
        for i in range(cfg["steps"]):
            order = cfg["engines"] if i % 2 == 0 else cfg["engines"][::-1]
            for engine in order:
                out["steps"][engine].append(step(engine))
        if cfg["profile"] and "ours" in models:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(3):
                step("ours")
            prof.disable()
            text = io.StringIO()
            stats = pstats.Stats(prof, stream=text)
            stats.sort_stats("tottime").print_stats(30)
            stats.sort_stats("cumulative").print_stats(40)
            out["profile"] = text.getvalue()
    if device == "cuda":
        out["cuda"] = {"max_memory_reserved": torch.cuda.max_memory_reserved()}
    dist.destroy_process_group()
    return out


def _minor_faults() -> int:
    """This thread's minor page faults so far (first touches of fresh memory: kernel time that
    ``thread_time`` counts), or 0 where unknown."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt)
    except (ImportError, AttributeError, OSError):
        return 0


def machine() -> dict[str, str]:
    """Where and when: CPU, cores, torch, load average, commit (uncommitted changes noted)."""
    import platform

    import torch

    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in _read("/proc/cpuinfo").splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    if torch.cuda.is_available():
        cpu += f"; GPU {torch.cuda.get_device_name(0)}"

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(ROOT), *args]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    if git("status", "--porcelain", "--", "packages", "benchmarks"):
        commit += " + uncommitted changes"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu,
        "nproc": str(os.cpu_count()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load": " ".join(_read("/proc/loadavg").split()[:3]) or "?",
        "commit": commit,
    }


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _host(step: dict[str, Any], clock: str) -> float:
    """A step's host time: its time outside the collectives, on this thread's CPU clock
    (``cpu``: what the engine's own work costs, whatever else the machine runs) or the wall
    clock (``wall``: also the waits, e.g. for a GPU)."""
    if clock == "cpu":
        return float(step["cpu"] - step["comm_cpu"])
    return float(step["wall"] - step["comm"])


def summarize(runs: list[dict[str, Any]], clock: str = "cpu") -> list[dict[str, Any]]:
    rows = []
    base_host: dict[str, float] = {}
    base_min: dict[str, float] = {}
    for run in sorted(runs, key=lambda r: r["world"]):
        m = run["world"]
        steps = run["steps"]
        host = {e: [_host(s, clock) for s in st] for e, st in steps.items()}
        for engine, st in steps.items():
            row: dict[str, Any] = {
                "world": m,
                "engine": engine,
                "setup_s": run["setup_s"][engine],
                "wall_median": _median([s["wall"] for s in st]),
                "wall_min": min(s["wall"] for s in st),
                "comm_median": _median([s["comm"] for s in st]),
                "host_median": _median(host[engine]),
                "host_min": min(host[engine]),
                "calls": st[-1]["calls"],
            }
            base_host.setdefault(engine, row["host_median"])
            base_min.setdefault(engine, row["host_min"])
            row["host_growth"] = row["host_median"] / base_host[engine]
            row["host_min_growth"] = row["host_min"] / base_min[engine]
            if engine != "fsdp2" and "fsdp2" in host:
                pairs = zip(host[engine], host["fsdp2"], strict=True)
                row["host_vs_fsdp2"] = _median([a / b for a, b in pairs])
                row["host_min_vs_fsdp2"] = row["host_min"] / min(host["fsdp2"])
                walls = zip(st, steps["fsdp2"], strict=True)
                row["wall_vs_fsdp2"] = _median([a["wall"] / b["wall"] for a, b in walls])
            rows.append(row)
    return rows


def _calls(calls: dict[str, int]) -> str:
    short = {"all_gather_single": "AG", "reduce_scatter_single": "RS", "all_reduce": "AR"}
    return " ".join(f"{short.get(k, k)} {v}" for k, v in sorted(calls.items()))


def markdown(rows: list[dict[str, Any]], info: dict[str, str], cfg: dict[str, Any]) -> str:
    lines = [
        f"{info['date']}; {info['cpu']}, {info['nproc']} cores; torch {info['torch']}; "
        f"device {cfg['device']}, {cfg['threads']} thread(s); load average at the end "
        f"{info['load']}; commit {info['commit']}.",
        "",
        f"`python benchmarks/bench_scale_host.py` — fake process group, rank 0 of m; "
        f"{cfg['layers']} blocks (LayerNorm({cfg['dim']}), Linear {cfg['dim']}->{cfg['hidden']}, "
        f"GELU, Linear {cfg['hidden']}->{cfg['dim']}) each `fully_shard`-ed + root, SGD, batch "
        f"{cfg['batch']}; {cfg['steps']} timed steps per engine after {cfg['warmup']} warm-up, "
        "engines alternating step by step in one process per m. "
        + (
            "Collectives skipped (`--collectives skip`: each returns at once, a completed work "
            "to async callers), so the step is the engines' own host work. "
            if cfg["collectives"] == "skip"
            else "Collectives run by the fake backend (`--collectives fake`), their time "
            "subtracted (the backend's own work, which grows with m for both engines and also "
            "evicts caches). "
        )
        + (
            "Host time = the main thread's CPU time (`time.thread_time`) of the step outside "
            "the collectives: what the engine's work costs whatever else the machine runs "
            "(the wall clock of a loaded machine also counts the waits for a core). "
            if cfg["clock"] == "cpu"
            else "Host time = the step's wall time outside the collectives. "
        )
        + "Headline figures are minimums over the timed steps (the least disturbed repeat of "
        "the same work), medians in brackets; the median ratio is the median of the paired "
        "per-step ratios. Wall-clock columns are for reference only on a loaded machine.",
        "",
        "| m | ours host ms min (median) | FSDP2 host ms min (median) | host ours / FSDP2 min "
        "(median) | ours host growth vs first m, min (median) | FSDP2 host growth min (median) "
        "| step wall ms ours / FSDP2 | wall ratio | in collectives ms ours / FSDP2 | "
        "collectives per step | fully_shard s ours / FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    by = {(r["world"], r["engine"]): r for r in rows}
    for m in sorted({r["world"] for r in rows}):
        o, f = by.get((m, "ours")), by.get((m, "fsdp2"))
        if o is None or f is None:
            continue
        lines.append(
            f"| {m} | {1e3 * o['host_min']:.1f} ({1e3 * o['host_median']:.1f}) | "
            f"{1e3 * f['host_min']:.1f} ({1e3 * f['host_median']:.1f}) | "
            f"{o['host_min_vs_fsdp2']:.2f}x ({o['host_vs_fsdp2']:.2f}x) | "
            f"{o['host_min_growth']:.2f}x ({o['host_growth']:.2f}x) | "
            f"{f['host_min_growth']:.2f}x ({f['host_growth']:.2f}x) | "
            f"{1e3 * o['wall_median']:.0f} / {1e3 * f['wall_median']:.0f} | "
            f"{o['wall_vs_fsdp2']:.2f}x | "
            f"{1e3 * o['comm_median']:.0f} / {1e3 * f['comm_median']:.0f} | "
            f"{_calls(o['calls'])} / {_calls(f['calls'])} | "
            f"{o['setup_s']:.2f} / {f['setup_s']:.2f} |"
        )
    lines += ["", *verdict(rows)]
    return "\n".join(lines) + "\n"


def verdict(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's targets: ours <= 0.8x FSDP2 at every m, ours grows <= 1.5x from the first
    m to the last; by the minimums (the headline) and by the medians."""
    ours = sorted((r for r in rows if r["engine"] == "ours"), key=lambda r: r["world"])
    if len(ours) < 2 or "host_vs_fsdp2" not in ours[0]:
        return []
    lines = []
    for label, ratio, growth in (
        ("minimums", "host_min_vs_fsdp2", "host_min_growth"),
        ("medians", "host_vs_fsdp2", "host_growth"),
    ):
        worst = max(r[ratio] for r in ours)
        grew = ours[-1][growth]
        ok = worst <= 0.8 and grew <= 1.5
        lines.append(
            f"- by the {label}: ours / FSDP2 at most {worst:.2f}x (target 0.8x), ours grows "
            f"{grew:.2f}x from m={ours[0]['world']} to m={ours[-1]['world']} (target 1.5x): "
            + ("met" if ok else "NOT met")
        )
    return lines


def chart(rows: list[dict[str, Any]], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (`pip install matplotlib`)")
        return False
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5), dpi=100)
    for engine in ENGINES:
        rs = sorted((r for r in rows if r["engine"] == engine), key=lambda r: r["world"])
        if not rs:
            continue
        ms = [r["world"] for r in rs]
        ax.plot(ms, [1e3 * r["host_min"] for r in rs], "o-", label=LABELS[engine])
        ax.fill_between(
            ms, [1e3 * r["host_min"] for r in rs], [1e3 * r["host_median"] for r in rs], alpha=0.2
        )
    ours = sorted((r for r in rows if r["engine"] == "ours"), key=lambda r: r["world"])
    if ours and "host_vs_fsdp2" in ours[0]:
        ms = [r["world"] for r in ours]
        bx.plot(ms, [r["host_min_vs_fsdp2"] for r in ours], "o-", label="ratio of minimums")
        bx.plot(ms, [r["host_vs_fsdp2"] for r in ours], "s--", label="paired median")
        bx.axhline(0.8, color="r", lw=0.8, ls=":", label="target 0.8")
        bx.axhline(1.0, color="k", lw=0.8)
    for a in (ax, bx):
        a.set_xscale("log", base=2)
        a.set_xlabel("world size m (fake process group)")
        a.grid(alpha=0.3)
        a.legend(fontsize=8)
    ax.set_ylabel("host CPU time per step, ms (min; band to median)")
    bx.set_ylabel("host time ours / FSDP2")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    return True


def run_child(cfg: dict[str, Any], timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"world {cfg['world']} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 1024, 8192, 16384])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--collectives",
        default="skip",
        choices=["skip", "fake"],
        help="skip: collectives return at once (host work only); fake: the fake backend runs them",
    )
    p.add_argument(
        "--clock",
        default=None,
        choices=["cpu", "wall"],
        help="host time on the main thread's CPU clock (default on CPU) or the wall clock "
        "(default on CUDA: the step ends with a synchronize)",
    )
    p.add_argument("--engines", nargs="+", default=list(ENGINES), choices=ENGINES)
    p.add_argument("--profile", action="store_true", help="cProfile ours at the largest m")
    p.add_argument("--name", default="bench_scale_host", help="output file stem")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world size")
    p.add_argument("--from-json", help="rewrite the table and chart from this JSON, no run")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        write(saved["raw"], saved["config"], saved["machine"], Path(args.out), args.name)
        return
    base = {
        k: getattr(args, k)
        for k in (
            "layers",
            "dim",
            "hidden",
            "batch",
            "steps",
            "warmup",
            "threads",
            "device",
            "collectives",
        )
    }
    base["engines"] = list(args.engines)
    base["clock"] = args.clock or ("wall" if args.device == "cuda" else "cpu")
    runs = []
    for m in args.worlds:
        cfg = dict(base, world=m, profile=args.profile and m == max(args.worlds))
        start = time.perf_counter()
        runs.append(run_child(cfg, args.timeout))
        print(f"m={m}: {time.perf_counter() - start:.0f} s", flush=True)
    write(runs, base, machine(), Path(args.out), args.name)


def write(
    runs: list[dict[str, Any]], cfg: dict[str, Any], info: dict[str, str], out: Path, name: str
) -> None:
    """The table (``<name>.md``, also printed), the JSON and the chart into ``out``."""
    rows = summarize(runs, cfg.get("clock", "wall"))
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, info, {"clock": "wall", **cfg})
    (out / f"{name}.md").write_text(table)
    payload = {"machine": info, "config": cfg, "rows": rows, "raw": runs}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    chart(rows, out / f"{name}.png", f"host time per step vs world size ({cfg['device']})")
    for run in runs:
        if "profile" in run:
            (out / f"{name}_profile.txt").write_text(
                f"cProfile of 3 steps of ours at m={run['world']}\n\n{run['profile']}"
            )
    print(table)


if __name__ == "__main__":
    main()
