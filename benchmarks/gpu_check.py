"""The pieces of ``gpu_check.sh`` (read its header first): one entry point per launch.

    python benchmarks/gpu_check.py preflight --out DIR          # versions, GPUs, engine compat
    python benchmarks/gpu_check.py train --engine ours --steps 20 --out run.json
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py bench --engine fsdp2 --out b.json
    torchrun --nproc-per-node 4 benchmarks/gpu_check.py stress --mixed --out s.json
    python benchmarks/gpu_check.py many < runs.txt              # several runs, one process
    python benchmarks/gpu_check.py report --out DIR [--parts parity,race,...]
    python benchmarks/gpu_check.py host ARGS...                 # bench_scale_host.py ARGS

``train`` trains a small residual MLP (fp32, or bf16 mixed precision with ``--mixed``) with AdamW
on one rank (NCCL on CUDA, gloo on CPU: a real world of one; or rank 0 of ``--fake-world`` on
the fake process group) and writes every loss (as exact float hex), the final shards' digest
and, on CUDA, ``torch.cuda.memory_stats`` peaks and ``max_memory_reserved``. It makes the
world-size-1 parity runs (ours and FSDP2: bitwise equal losses and parameters, the same
arithmetic) and the stream-race runs (rank 0 of 4 on the fake process group, repeated with
``CUDA_LAUNCH_BLOCKING=0`` twice and ``=1`` once: bitwise identical; world size 1 would not do:
there the engine issues no collective and uses no communication stream).

``bench`` and ``stress`` (``gpu_check_runs.py``): one engine's side-by-side benchmark run, and
the stress race check of ours against a one-process reference; under ``torchrun`` they run on
every rank (NCCL on GPUs, gloo on CPU), otherwise on one process (``--fake-world``).

``many`` reads runs from stdin (or ``--file``), one a line: ``[VAR=value ...] SUBCOMMAND
ARGS...``, and runs them in order in this process (the dry mode: one torch import for all;
under torchrun the runs share one process group, so a variable read when the process group is
made, such as ``TORCH_NCCL_AVOID_RECORD_STREAMS``, is only recorded there).

``report`` (``gpu_check_report.py``) writes ``summary.md``, ``gpu_bench.md`` and
``gpu_check.json`` and exits non-zero if a selected part failed or is missing.

Every launch stops itself: with ``GPU_CHECK_DEADLINE_S`` set (the script sets it to the
launch's time limit), all threads' stacks are dumped and the process exits 10 s before it, and
process groups time out within the limit, so a hung collective ends as a failure, not a hang.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))


def _free_port() -> int:
    from gpu_check_runs import _free_port as free

    return free()


def train(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from bench_scale_host import build_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    device = args.device
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(0)
    world = args.fake_world
    if world > 1:
        # rank 0 of ``world`` on the fake backend: no communication, but every collective path
        # of the engine runs (all-gather / reduce-scatter streams, prefetch, the low-precision
        # cast), and the data stays deterministic: the fake all-gather copies this rank's shard
        # into every chunk, its reduce-scatter keeps this rank's chunk
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    try:
        mesh = init_device_mesh(device, (world,))
        torch.manual_seed(0)
        model = build_model(args.layers, args.dim, args.hidden).to(device)
        if args.engine == "ours":
            import fsdp_engine as api
        else:
            import torch.distributed.fsdp as api  # type: ignore[no-redef]
        mp = (
            api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if args.mixed
            else api.MixedPrecisionPolicy()
        )
        for block in model.blocks:
            api.fully_shard(block, mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=args.foreach)
        gen = torch.Generator().manual_seed(1)
        data = [
            (
                torch.randn(args.batch, args.dim, generator=gen),
                torch.randn(args.batch, 1, generator=gen),
            )
            for _ in range(4)
        ]
        data = [(x.to(device), y.to(device)) for x, y in data]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        losses = []
        for step in range(args.steps):
            x, y = data[step % len(data)]
            loss = (model(x).float() - y).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        values = [float(v) for v in torch.stack(losses).cpu()]  # one sync, at the end
        digest = hashlib.sha256()
        for name, param in sorted(model.named_parameters()):
            # this rank's shard (the whole parameter at world size 1)
            local = param.to_local() if isinstance(param, DTensor) else param
            digest.update(name.encode())
            digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        out: dict[str, Any] = {
            "engine": args.engine,
            "device": device,
            "mixed": args.mixed,
            "steps": args.steps,
            "world": world,
            "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", ""),
            "losses": [v.hex() for v in values],
            "params_sha256": digest.hexdigest(),
        }
        if device == "cuda":
            stats = torch.cuda.memory_stats()
            out["memory"] = {
                key: int(stats.get(key, 0))
                for key in (
                    "allocated_bytes.all.peak",
                    "active_bytes.all.peak",
                    "reserved_bytes.all.peak",
                    "num_alloc_retries",
                )
            }
            out["memory"]["max_memory_reserved"] = int(torch.cuda.max_memory_reserved())
        return out
    finally:
        dist.destroy_process_group()


def torch_shims() -> list[str]:
    """Alias the ``torch.distributed`` names the packages call that this torch lacks to their
    older spellings, for this process only: ``all_gather_single`` and ``reduce_scatter_single``
    (torch 2.13; the same signatures as ``all_gather_into_tensor`` / ``reduce_scatter_tensor``),
    so the check runs on a GPU machine's own, older torch. Returns what was aliased (the
    report's header names it)."""
    import torch.distributed as dist

    aliased = []
    for new, old in (
        ("all_gather_single", "all_gather_into_tensor"),
        ("reduce_scatter_single", "reduce_scatter_tensor"),
    ):
        if not hasattr(dist, new) and hasattr(dist, old):
            setattr(dist, new, getattr(dist, old))
            aliased.append(f"torch.distributed.{new} = {old}")
    return aliased


def smoke(device: Any) -> None:
    """Two steps of each engine as rank 0 of 2 on the fake process group (all-gathers and
    reduce-scatters run): fails at once where the packages do not run on this torch."""
    import torch
    import torch.distributed as dist
    from bench_scale_host import build_model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    for engine in ("ours", "fsdp2"):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            mesh = init_device_mesh(device.type, (2,))
            model = build_model(2, 16, 32).to(device)
            if engine == "ours":
                import fsdp_engine as api
            else:
                import torch.distributed.fsdp as api  # type: ignore[no-redef]
            for block in model.blocks:
                api.fully_shard(block, mesh=mesh)
            api.fully_shard(model, mesh=mesh)
            opt = torch.optim.AdamW(model.parameters())
            for _ in range(2):
                model(torch.randn(4, 16, device=device)).sum().backward()
                opt.step()
                opt.zero_grad()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        finally:
            dist.destroy_process_group()


def preflight(args: argparse.Namespace) -> dict[str, Any]:
    """What the run depends on: torch, CUDA, NCCL, the GPUs, the engine's torch compatibility;
    then ``smoke`` on the first GPU (or the CPU)."""
    import torch

    import fsdp_engine
    from fsdp_engine._private.compat import compat_status

    cuda = torch.cuda.is_available()
    status = compat_status()
    problems = [
        f"{k}: {v}" for k, v in status.items() if k != "torch" and v not in {"torch", "marked"}
    ]
    if status.get("torch") == "unsupported":
        problems.insert(0, "torch version not the one the engine was checked against (2.13)")
    nccl = "-"
    if cuda:
        with contextlib.suppress(Exception):  # a tuple on recent torch, an int on old ones
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    commit = os.environ.get("GPU_CHECK_COMMIT", "")
    if not commit:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            commit = subprocess.run(
                ["git", "-C", str(HERE.parent), "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
    info: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "-",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "device_name": torch.cuda.get_device_name(0) if cuda else f"CPU ({os.cpu_count()} cores)",
        "nccl": nccl,
        "gpu_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        if cuda
        else None,
        "compat": "ok" if not problems else "; ".join(problems),
        "compat_status": status,
        "engine_from": str(Path(fsdp_engine.__file__).parent),
        "commit": commit or "unknown",
        "shims": torch_shims(),
    }
    if args.require_cuda and not cuda:
        raise SystemExit("no CUDA device: use --dry")
    smoke(torch.device("cuda", 0) if cuda else torch.device("cpu"))
    print(json.dumps(info, indent=1))
    print(f"gpu_count={info['gpus']}")
    return info


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pre = sub.add_parser("preflight")
    pre.add_argument("--require-cuda", action="store_true")
    pre.add_argument("--out", required=True, help="folder: writes preflight.json there")

    t = sub.add_parser("train")
    t.add_argument("--engine", choices=["ours", "fsdp2"], required=True)
    t.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    t.add_argument("--steps", type=int, default=20)
    t.add_argument("--layers", type=int, default=8)
    t.add_argument("--dim", type=int, default=256)
    t.add_argument("--hidden", type=int, default=1024)
    t.add_argument("--batch", type=int, default=32)
    t.add_argument("--mixed", action="store_true", help="bf16 parameters for compute")
    t.add_argument(
        "--fake-world",
        type=int,
        default=1,
        help="> 1: rank 0 of this many on the fake process group (every stream path, no data "
        "moved); 1: a real world of one (NCCL / gloo)",
    )
    t.add_argument("--foreach", type=lambda s: None if s == "default" else s == "1", default=None)
    t.add_argument("--out", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
        q.add_argument(
            "--fake-world", type=int, default=1, help="one process: rank 0 of this many (fake)"
        )
        q.add_argument("--mixed", action="store_true", help="bf16 compute, fp32 reduction")
        q.add_argument("--pg-timeout", type=float, default=300.0, help="process group, seconds")
        q.add_argument("--out", required=True)

    b = sub.add_parser("bench", help="one engine's run of the side-by-side benchmark")
    common(b)
    b.add_argument("--engine", choices=["ours", "fsdp2"], required=True)
    b.add_argument("--config", required=True, help="label of the configuration (report rows)")
    b.add_argument("--index", type=int, default=0, help="the run's number (1, 2, ...)")
    b.add_argument("--hsdp", action="store_true", help="2 replicas x world/2 shards")
    for name, default in (
        ("dim", 2048),
        ("layers", 8),
        ("heads", 16),
        ("ffn", 5632),
        ("vocab", 32000),
        ("seq", 1024),
        ("batch", 4),
        ("warmup", 3),
        ("steps", 15),
    ):
        b.add_argument(f"--{name}", type=int, default=default)

    s = sub.add_parser("stress", help="ours under sleeps and empty_cache vs a reference")
    common(s)
    for name, default in (("dim", 1024), ("hidden", 4096), ("layers", 8), ("batch", 64)):
        s.add_argument(f"--{name}", type=int, default=default)
    s.add_argument("--steps", type=int, default=50)
    s.add_argument("--lr", type=float, default=1e-3)
    s.add_argument("--sleep-cycles", type=int, default=2_000_000, help="max per sleep kernel")
    s.add_argument("--host-sleep", type=float, default=0.0, help="CPU stand-in, max seconds")
    s.add_argument("--serial", action="store_true", help="no sleeps or empty_cache: the reference")
    s.add_argument("--hsdp", action="store_true", help="2 replicas x world/2 shards")
    s.add_argument("--custom-collectives", action="store_true", help="user all-gather/RS")
    s.add_argument("--inplace-grads", action="store_true", help="zero_grad keeps .grad")
    s.add_argument("--float8", action="store_true", help="FP8 quantized all-gather (bf16)")

    h = sub.add_parser("host", help="bench_scale_host.py ARGS (with this torch's shims)")
    h.add_argument("args", nargs=argparse.REMAINDER)
    many = sub.add_parser("many", help="runs from stdin or --file, one a line, one process")
    many.add_argument("--file")
    r = sub.add_parser("report")
    r.add_argument("--out", required=True)
    r.add_argument("--parts", default="all", help="comma-separated, of: parity,race,stress,...")
    r.add_argument("--dry", action="store_true")
    return p


def run(args: argparse.Namespace) -> None:
    """One subcommand; writes its JSON to ``--out`` (rank 0 only under torchrun)."""
    import gpu_check_runs

    deadline = float(os.environ.get("GPU_CHECK_DEADLINE_S", "0") or 0)
    if deadline > 0 and hasattr(args, "pg_timeout"):  # a hung collective fails before then
        args.pg_timeout = min(args.pg_timeout, max(20.0, deadline - 15.0))

    if args.cmd == "preflight":
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "preflight.json").write_text(json.dumps(preflight(args), indent=1))
        return
    if args.cmd == "host":
        import runpy

        argv, sys.argv = sys.argv, [str(HERE / "bench_scale_host.py"), *args.args]
        try:
            runpy.run_path(sys.argv[0], run_name="__main__")
        finally:
            sys.argv = argv
        return
    if args.cmd == "train":
        result = train(args)
    elif args.cmd == "bench":
        result = gpu_check_runs.bench(args)
    elif args.cmd == "stress":
        result = gpu_check_runs.stress(args)
    else:
        raise SystemExit(f"gpu_check.py: {args.cmd} cannot run here")
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(json.dumps(result, indent=1))


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    if words[:1] == ["host"]:  # every argument is bench_scale_host.py's (argparse would take them)
        return argparse.Namespace(cmd="host", args=words[1:])
    return parser.parse_args(words)


def many(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    import gpu_check_runs

    gpu_check_runs.KEEP_PROCESS_GROUP = True
    text = Path(args.file).read_text() if args.file else sys.stdin.read()
    try:
        for line in text.splitlines():
            words = shlex.split(line)
            if not words:
                continue
            env = {}
            while words and "=" in words[0] and not words[0].startswith("-"):
                key, value = words.pop(0).split("=", 1)
                env[key] = value
            saved: dict[str, str | None] = {key: os.environ.get(key) for key in env}
            os.environ.update(env)
            try:
                print(f"== {line}", flush=True)
                run(_parse(parser, words))
            finally:
                for name, before in saved.items():
                    if before is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = before
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> None:
    deadline = float(os.environ.get("GPU_CHECK_DEADLINE_S", "0") or 0)
    if deadline > 0:  # never hang: stacks to stderr and exit before the launch's time limit
        faulthandler.dump_traceback_later(max(5.0, deadline - 10.0), exit=True)
    parser = _parser()
    args = _parse(parser, sys.argv[1:])
    if args.cmd != "report":
        torch_shims()
    if args.cmd == "report":
        from gpu_check_report import PARTS, report

        parts = list(PARTS) if args.parts == "all" else args.parts.split(",")
        unknown = sorted(set(parts) - set(PARTS))
        if unknown:
            raise SystemExit(f"gpu_check.py report: unknown parts {unknown}; known: {PARTS}")
        sys.exit(report(Path(args.out), parts, args.dry))
    if args.cmd == "many":
        many(args, parser)
        return
    run(args)


if __name__ == "__main__":
    main()
