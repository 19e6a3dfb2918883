"""The pieces of ``gpu_check.sh``: world-size-1 training on one device, and the report.

    python benchmarks/gpu_check.py train --engine ours --device cuda --steps 20 --out run.json
    python benchmarks/gpu_check.py report --out results/gpu_check

``train`` trains a small residual MLP (fp32, or bf16 mixed precision with ``--mixed``) with AdamW
on one rank (NCCL on CUDA, gloo on CPU: a real world of one; or rank 0 of ``--fake-world`` on
the fake process group) and writes every loss (as exact float hex), the final shards' digest
and, on CUDA, ``torch.cuda.memory_stats`` peaks and ``max_memory_reserved``. ``report``
compares the runs ``gpu_check.sh`` made:

- parity: ours and FSDP2 give bitwise equal losses and parameters (same arithmetic: world size 1,
  the same kernels in the same order, deterministic algorithms on);
- stream race: the same run of ours, as rank 0 of 4 on the fake process group (``--fake-world
  4``: every all-gather, reduce-scatter, prefetch and cast runs on its stream; the fake backend's
  copies keep the data deterministic), repeated with ``CUDA_LAUNCH_BLOCKING=0`` (twice) and
  ``=1`` (kernels serialised: the reference) gives bitwise identical, finite losses and shards
  (a missing stream wait reads or frees memory early and changes them). World size 1 would not
  do: there the engine issues no collective and uses no communication stream;
- the CUDA sanitizer's verdict on 5 steps of the race run (``sanitizer.txt``, its log);
- memory: peaks ours vs FSDP2;
- the host benchmark's table (``bench_scale_host.py --device cuda``).

It writes ``summary.md`` and exits non-zero if parity or the race check fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import socket
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def report(args: argparse.Namespace) -> int:
    out = Path(args.out)
    lines = ["# gpu_check", ""]
    failures: list[str] = []
    lines.append("## parity at world size 1 (bitwise: losses and final parameters)")
    lines.append("")
    for case in ("fp32", "bf16"):
        ours, theirs = (
            _load(out / f"parity_ours_{case}.json"),
            _load(out / f"parity_fsdp2_{case}.json"),
        )
        same = (
            ours["losses"] == theirs["losses"] and ours["params_sha256"] == theirs["params_sha256"]
        )
        first = next(
            (
                i
                for i, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True))
                if a != b
            ),
            None,
        )
        lines.append(
            f"- {case}: {'equal' if same else 'DIFFERENT'} over {ours['steps']} steps"
            + ("" if first is None else f" (first differing loss at step {first})")
            + f"; last loss {float.fromhex(ours['losses'][-1]):.6g}"
        )
        if not same:
            failures.append(f"parity {case}")
    lines += ["", "## stream race (bitwise identical losses run to run)", ""]
    runs = sorted(out.glob("race_*.json"))
    reference = _load(runs[0]) if runs else None
    for path in runs:
        run = _load(path)
        same = reference is not None and run["losses"] == reference["losses"]
        same = same and reference is not None and run["params_sha256"] == reference["params_sha256"]
        finite = all(math.isfinite(float.fromhex(v)) for v in run["losses"])
        lines.append(
            f"- {path.stem}: CUDA_LAUNCH_BLOCKING={run['launch_blocking'] or 'unset'}, "
            f"world {run.get('world', 1)} (fake process group), {run['steps']} steps: "
            f"{'identical' if same else 'DIFFERENT'}"
            + ("" if finite else " (non-finite losses: the comparison proves nothing)")
        )
        if not same:
            failures.append(f"race {path.stem}")
        if not finite:
            failures.append(f"race {path.stem} not finite")
    if len(runs) < 3:
        failures.append(f"race: {len(runs)} runs found, expected 3")
    sanitizer = out / "sanitizer.txt"
    verdict = sanitizer.read_text().strip() if sanitizer.exists() else "(missing)"
    lines += ["", "## CUDA sanitizer (TORCH_CUDA_SANITIZER=1, 5 steps of the race run)", ""]
    lines.append(f"- {verdict}")
    if not verdict.startswith(("passed", "not run")):
        failures.append("sanitizer")
        log = out / "sanitizer.log"
        if log.exists():
            lines += ["", "```", *log.read_text().splitlines()[-40:], "```"]
    lines += ["", "## memory (torch.cuda.memory_stats, one training run each)", ""]
    mem = {e: _load(out / f"parity_{e}_bf16.json").get("memory") for e in ("ours", "fsdp2")}
    if mem["ours"] and mem["fsdp2"]:
        lines.append("| stat | ours MiB | FSDP2 MiB | ours / FSDP2 |")
        lines.append("|---|---|---|---|")
        for key, value in mem["ours"].items():
            other = mem["fsdp2"][key]
            ratio = f"{value / other:.2f}x" if other else "-"
            scale = 2**20 if "bytes" in key or key == "max_memory_reserved" else 1
            lines.append(f"| {key} | {value / scale:.1f} | {other / scale:.1f} | {ratio} |")
    else:
        lines.append("(no CUDA: no memory statistics in the dry run)")
    host = out / "scale_host.md"
    lines += ["", "## host benchmark (fake process group, device tensors)", ""]
    lines.append(host.read_text() if host.exists() else "(missing)")
    lines += ["", "result: " + ("FAILED: " + ", ".join(failures) if failures else "passed")]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    print(text)
    return 1 if failures else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
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
    many = sub.add_parser("train-many", help="runs from stdin, one process (the dry run)")
    many.add_argument("--device", default="cpu", choices=["cuda", "cpu"])
    for name, default in (("layers", 8), ("dim", 256), ("hidden", 1024), ("batch", 32)):
        many.add_argument(f"--{name}", type=int, default=default)
    r = sub.add_parser("report")
    r.add_argument("--out", required=True)
    args = p.parse_args()
    if args.cmd == "train":
        result = train(args)
        Path(args.out).write_text(json.dumps(result, indent=1))
        return
    if args.cmd == "train-many":
        for line in sys.stdin.read().splitlines():
            engine, case, steps, world, blocking, out = line.split()
            run = argparse.Namespace(**vars(args))
            run.engine, run.mixed, run.steps, run.out = engine, case == "bf16", int(steps), out
            run.fake_world = int(world)
            run.foreach = None
            if blocking != "-":
                os.environ["CUDA_LAUNCH_BLOCKING"] = blocking
            else:
                os.environ.pop("CUDA_LAUNCH_BLOCKING", None)
            Path(out).write_text(json.dumps(train(run), indent=1))
        return
    sys.exit(report(args))


if __name__ == "__main__":
    main()
