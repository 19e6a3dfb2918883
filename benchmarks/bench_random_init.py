"""Random init of a meta-initialized sharded model: peak memory growth and time, ours vs FSDP2.

Two models of 1 GiB (fp32), built on the meta device, each layer and the root
``fully_shard``-ed, then ``model.to_empty(device=...)`` and every module's
``reset_parameters()`` (what a user runs): ``embedding``, one ``Embedding(65536, 4096)``
(``normal_``; one parameter of 1 GiB, the case where a full-size temporary hurts most), and
``linear``, ``nn.Sequential`` of 16 ``Linear(4096, 4096)`` (``kaiming_uniform_`` and
``uniform_``; 64 MiB parameters). ``--scale`` divides both (for a quick run).
Measured on every rank, over ``to_empty`` + ``reset_parameters``:

- **peak growth**: the peak resident set (``VmHWM`` of ``/proc/self/status``, reset through
  ``/proc/self/clear_refs`` just before) minus the resident set just before, in MiB: what the
  operating system had to give the process, temporaries included (on CUDA:
  ``torch.cuda.max_memory_allocated`` growth instead);
- **time**: wall clock of the same span, with a barrier before and after.

Each engine runs in its own fresh processes (a freed allocation may stay in the allocator's
heap and hide the next one's growth). Engines: ``ours`` (``fsdp_engine``), ``fsdp2`` (torch's),
and ``ours-full`` (ours with the share-only draw switched off: the previous full-tensor draw,
for comparison). Values: ours equals one device's init bitwise (tests); FSDP2 on CPU draws each
shard from its own rank's stream (not one device's values).

    python benchmarks/bench_random_init.py                       # 2 and 4 ranks, ours and fsdp2
    python benchmarks/bench_random_init.py --engines ours ours-full fsdp2 --worlds 2 --scale 8
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard as ours_fully_shard
from ragged_dtensor.testing import run_processes

MIB = 1 << 20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _model(name: str, scale: int) -> nn.Module:
    if name == "embedding":
        return nn.Sequential(nn.Embedding(65536 // scale, 4096))
    return nn.Sequential(*[nn.Linear(4096 // scale, 4096) for _ in range(16)])


def _rank(rank: int, world: int, engine: str, name: str, scale: int, device: str) -> Any:
    if engine == "ours-full":
        from ragged_dtensor._private import random_stream

        random_stream.draw_share = lambda *args, **kwargs: False  # the previous path
    torch.manual_seed(0)
    mesh = init_device_mesh(device, (world,))
    shard = fsdp2_fully_shard if engine == "fsdp2" else ours_fully_shard
    with torch.device("meta"):
        model = _model(name, scale)
    for layer in model:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    gc.collect()
    cuda = device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # reset VmHWM to the current resident set
        before = _status_kib("VmRSS") * 1024
    dist.barrier()
    start = time.perf_counter()
    model.to_empty(device=device)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    if cuda:
        torch.cuda.synchronize()
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _status_kib("VmHWM") * 1024
    params = sum(p.numel() for p in model.parameters())
    return {"growth_mib": (peak - before) / MIB, "seconds": seconds, "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--engines", nargs="+", default=["ours", "fsdp2"])
    parser.add_argument("--models", nargs="+", default=["embedding", "linear"])
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    print(
        f"to_empty + reset_parameters on {args.device} of a meta-initialized model; peak growth "
        f"per rank (the largest over ranks), time (median over ranks)"
    )
    print("| model | m | engine | peak growth MiB | vs fsdp2 | shard MiB | time s | vs fsdp2 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for name in args.models:
        for world in args.worlds:
            rows = {}
            for engine in args.engines:
                out = run_processes(
                    _rank, world, engine, name, args.scale, args.device, timeout=args.timeout
                )
                params = out[0]["params"]
                rows[engine] = (
                    max(r["growth_mib"] for r in out),
                    statistics.median(r["seconds"] for r in out),
                )
            shard = params * 4 / MIB / world
            for engine, (growth, seconds) in rows.items():
                ref = rows.get("fsdp2")
                vs_mem = f"{growth / ref[0]:.2f}x" if ref else "-"
                vs_time = f"{seconds / ref[1]:.2f}x" if ref else "-"
                print(
                    f"| {name} ({params * 4 / (1 << 30):.2f} GiB) | {world} | {engine} | "
                    f"{growth:.0f} | {vs_mem} | {shard:.0f} | {seconds:.1f} | {vs_time} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
