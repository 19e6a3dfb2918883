"""Distributed Muon side by side: ours (one root per matrix) vs torch.optim.Muon vs gather-to-all.

Real gloo processes at each world size, the same LLaMA-like set of matrices and the same
gradients on every variant; only the optimizer step is timed (medians and mins of several steps,
alternating variants). Variants:

- ours, ``RaggedShard``: ``optim_blockwise.Muon`` on RaggedShard params (element granularity,
  equal shares): per bucket one all-to-all to each matrix's owner and one back;
- ours, FSDP2 ``Shard(0)``: the same optimizer on ``Shard(0)`` DTensors (torch.chunk split);
- ``torch.optim.Muon`` on the same ``Shard(0)`` DTensors (DTensor ops redistribute per matrix);
- gather-to-all (Moonlight style): one batched all-gather of every padded shard, Newton-Schulz of
  every matrix on every rank, keep the own slice.

Reported per variant: step time (median / min, ms; ratio to ours), collectives per step, bytes
this rank sends per step (all-gather: (w-1) x input; all-reduce: 2 (w-1)/w x size; all-to-all:
the pieces for other ranks), and the largest deviation from single-device Muon after the steps.
Writes ``distributed_muon.md`` into the results folder (default ``results/``).

    python bench_optim_distributed_muon.py [results] [--worlds 2 4] [--steps 6]
"""

from __future__ import annotations

import argparse
import io
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

import optim_blockwise as ob
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_processes


def shapes_for(dim: int, layers: int) -> list[tuple[int, int]]:
    ffn = 3 * dim
    per_layer = [(3 * dim, dim), (dim, dim), (ffn, dim), (ffn, dim), (dim, ffn)]
    return per_layer * layers


class CollectiveCounter(TorchDispatchMode):
    """Counts functional/c10d collectives that go through the dispatcher and the bytes sent."""

    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.count = 0
        self.bytes = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor desugar into collectives on plain tensors first (as CommDebugMode).
            return NotImplemented
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        ns = func.namespace
        if ns in ("_c10d_functional", "c10d"):
            name = func.__name__
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            lists = [
                t
                for a in args
                if isinstance(a, list | tuple)
                for t in a
                if isinstance(t, torch.Tensor)
            ]
            size = sum(t.numel() * t.element_size() for t in tensors + lists)
            if "wait" not in name:
                self.count += 1
                w = self.world
                if "all_gather" in name or "allgather" in name:
                    self.bytes += (w - 1) * size
                elif "all_reduce" in name or "allreduce" in name:
                    self.bytes += int(2 * (w - 1) / w * size)
                else:
                    self.bytes += int((w - 1) / w * size)
        return func(*args, **(kwargs or {}))


@torch.no_grad()
def gather_to_all_step(
    params: list[DTensor], bufs: list[torch.Tensor], world: int, lr: float, wd: float
) -> dict[str, int]:
    """Moonlight-style: gather every matrix everywhere (one batched padded all-gather), NS on
    every rank, keep the own slice. Same momentum / NS / lr arithmetic as ours."""
    coord = dist.get_rank()
    updates, metas = [], []
    for p, buf in zip(params, bufs, strict=True):
        g = p.grad.to_local().reshape(-1).float()  # type: ignore[union-attr]
        buf.mul_(0.95).add_(g * 0.05)
        updates.append(g.mul(0.05).add_(buf * 0.95).bfloat16())
        metas.append(tuple(p.shape))
    ranges = [ob_chunk_ranges(m, world) for m in metas]
    width = sum(max(hi - lo for lo, hi in r) for r in ranges)
    send = torch.zeros(width, dtype=torch.bfloat16)
    pos = 0
    for u, r in zip(updates, ranges, strict=True):
        send[pos : pos + u.numel()] = u
        pos += max(hi - lo for lo, hi in r)
    out = [torch.empty_like(send) for _ in range(world)]
    dist.all_gather([o.view(torch.uint8) for o in out], send.view(torch.uint8))  # gloo: no bf16
    pos = 0
    for p, shape, r in zip(params, metas, ranges, strict=True):
        width_i = max(hi - lo for lo, hi in r)
        full = torch.cat([out[k][pos : pos + hi - lo] for k, (lo, hi) in enumerate(r)])
        pos += width_i
        ortho = ob.newton_schulz(full.view(shape)).reshape(-1)
        local = p.to_local().reshape(-1)
        lo, hi = r[coord]
        local.mul_(1 - lr * wd)
        local.sub_(ortho[lo:hi].float().mul(ob.adjust_lr(lr, "match_rms_adamw", shape)))
    return {"collectives": 1, "bytes_sent": (world - 1) * width * 2}


def ob_chunk_ranges(shape: tuple[int, ...], world: int) -> tuple[tuple[int, int], ...]:
    from optim_blockwise._private.layout import chunk_ranges

    return chunk_ranges(shape, world)


def worker(rank: int, world: int, dim: int, layers: int, steps: int) -> bytes:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    shapes = shapes_for(dim, layers)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    lr, wd = 0.01, 0.1

    def ragged(full: torch.Tensor) -> DTensor:
        units = tuple([1] * world)
        pl = RaggedShard((0, 1), units)
        r = pl.flat_range(full.shape, rank)
        return DTensor.from_local(
            full.reshape(-1)[r.start : r.stop].clone(),
            mesh,
            [pl],
            shape=full.shape,
            stride=full.stride(),
            run_check=False,
        )

    def chunk(full: torch.Tensor) -> DTensor:
        return distribute_tensor(full.clone(), mesh, [Shard(0)])

    variants: dict[str, Any] = {}
    for name, make in (
        ("ours, RaggedShard", ragged),
        ("ours, FSDP2 Shard(0)", chunk),
        ("torch.optim.Muon, FSDP2 Shard(0)", chunk),
        ("gather-to-all", chunk),
    ):
        params = [torch.nn.Parameter(make(f)) for f in init]
        if name.startswith("ours"):
            opt: Any = ob.Muon(params, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
        elif name.startswith("torch"):
            opt = torch.optim.Muon(params, lr=lr, weight_decay=wd, adjust_lr_fn="match_rms_adamw")
        else:
            opt = [torch.zeros(p.to_local().numel()) for p in params]
        variants[name] = {"params": params, "opt": opt, "make": make, "times": [], "stats": None}

    for step in range(steps):
        for name, v in variants.items():  # alternate variants within each step
            for p, g in zip(v["params"], grads[step], strict=True):
                p.grad = v["make"](g)
            counter = CollectiveCounter(world)
            dist.barrier()
            start = time.perf_counter()
            with counter:
                if name == "gather-to-all":
                    stats = gather_to_all_step(v["params"], v["opt"], world, lr, wd)
                else:
                    v["opt"].step()
                    stats = dict(getattr(v["opt"], "last_step_stats", {}))
            elapsed = time.perf_counter() - start
            if step >= 1:  # first step: state allocation and plan caching
                v["times"].append(elapsed)
            if name.startswith("torch"):
                stats = {"collectives": counter.count, "bytes_sent": counter.bytes}
            v["stats"] = stats
    out: dict[str, Any] = {}
    for name, v in variants.items():
        out[name] = {
            "times": v["times"],
            "stats": v["stats"],
            "locals": [p.detach().to_local().reshape(-1).clone() for p in v["params"]],
        }
    buffer = io.BytesIO()
    torch.save(out, buffer)
    return buffer.getvalue()


def single_device(dim: int, layers: int, steps: int) -> list[torch.Tensor]:
    shapes = shapes_for(dim, layers)
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(s, generator=gen) * 0.02 for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    params = [torch.nn.Parameter(f.clone()) for f in init]
    opt = ob.Muon(params, lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    for step in range(steps):
        for p, g in zip(params, grads[step], strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach().reshape(-1) for p in params]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="results")
    parser.add_argument("--out", dest="out_opt", default=None, help="(as the positional)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    out = Path(args.out_opt or args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = shapes_for(args.dim, args.layers)
    numel = sum(math.prod(s) for s in shapes)
    reference = single_device(args.dim, args.layers, args.steps)
    lines = [
        f"Muon optimizer step on {len(shapes)} matrices of a LLaMA-like stack (dim {args.dim}, "
        f"{args.layers} layers, {numel / 1e6:.2f} M params, fp32 params, bf16 Newton-Schulz), "
        f"gloo on CPU, 1 thread per rank, {args.steps - 1} timed steps, torch "
        f"{torch.__version__}. Momentum is {4 * numel / 2**20:.1f} MiB in fp32.",
        "",
    ]
    for world in args.worlds:
        per_rank = [
            torch.load(io.BytesIO(b), weights_only=True)
            for b in run_processes(worker, world, args.dim, args.layers, args.steps, timeout=600)
        ]
        names = list(per_rank[0])
        # A step takes as long as its slowest rank: per variant, the max over ranks of medians.
        ours_median = max(statistics.median(r[names[0]]["times"]) for r in per_rank)
        lines += [
            f"### world size {world}",
            "",
            "| variant | step median (ms) | step min (ms) | time vs ours (RaggedShard) "
            "| collectives / step / rank | MiB sent / step / rank (max over ranks) "
            "| max abs diff vs single device |",
            "|---|---|---|---|---|---|---|",
        ]
        for name in names:
            times = [t for r in per_rank for t in r[name]["times"]]
            per_rank_median = max(statistics.median(r[name]["times"]) for r in per_rank)
            sent = max(r[name]["stats"].get("bytes_sent", 0) for r in per_rank) / 2**20
            colls = per_rank[0][name]["stats"].get("collectives", 0)
            diff = 0.0
            for i, ref in enumerate(reference):
                whole = torch.cat([r[name]["locals"][i] for r in per_rank])
                diff = max(diff, float((whole - ref).abs().max()))
            lines.append(
                f"| {name} | {1000 * per_rank_median:.1f} | {1000 * min(times):.1f} "
                f"| {per_rank_median / ours_median:.2f}x | {colls} | {sent:.2f} | {diff:.2e} |"
            )
        lines.append("")
    lines.append(
        "Ours: per bucket one all-to-all to the owners and one back, pipelined against "
        "Newton-Schulz (the plan and its agreement all-gather happen once, in the first step; "
        "steps shown are after it). torch.optim.Muon's collectives are the DTensor functional "
        "collectives seen by a dispatch mode. Gather-to-all runs every Newton-Schulz on every "
        "rank."
    )
    (out / "distributed_muon.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
