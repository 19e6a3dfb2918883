"""DBuffer vs FSDP2 on the parameters of one LLaMA-like block, world size 2, in one run.

Run: ``python packages/dbuffer/benchmarks/bench_dbuffer.py [--dim 512] [--steps 20] [--out DIR]``.
Spawns 2 gloo processes itself, prints a markdown table and writes JSON.

Compared paths (the same parameter shapes, the same data, alternating within one loop):
- all-gather: FSDP2 ``FSDPModule.unshard()`` (``foreach_all_gather``: copy-in of every shard into
  the send buffer, all-gather, ``foreach_all_gather_copy_out``: split into per-parameter tensors)
  plus ``reshard()``, against ``DBuffer.unshard()`` plus ``reshard()``;
- reduce-scatter: FSDP2 ``FSDPParamGroup.post_backward()`` (``foreach_reduce``: copy-in of every
  unsharded gradient into the reduce-scatter input, reduce-scatter, the sharded gradients) against
  ``DBuffer.reduce_scatter(op="avg")``; in both, the unsharded gradients exist before the timed
  region (autograd made them) and the average over ranks is taken.

Per path: median and min wall time over the steps (rank 0; both ranks are in lock-step behind a
barrier), bytes written by copy-like ops (``CopiedBytes``; gloo's own reduce-scatter copies its
result out of an internal buffer, measured on a bare collective and reported apart), and peak
live bytes (``LiveBytes`` seeded with the persistent storages the path starts from).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import CopiedBytes, LiveBytes, load_full_
from ragged_dtensor.testing import run_processes


class Block(nn.Module):
    """LLaMA-like decoder block parameters: 2 RMSNorm weights, q/k/v/o, SwiGLU w1/w3/w2."""

    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.attention_norm = nn.Parameter(torch.ones(dim))
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = nn.Parameter(torch.ones(dim))
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False)
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x * self.attention_norm
        q, k, v = self.wq(h), self.wk(h), self.wv(h)
        scores = torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1)
        x = x + self.wo(scores @ v)
        h = x * self.ffn_norm
        out: torch.Tensor = x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h))
        return out


def _barrier_time(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _measure(fn: Any, seed: list[torch.Tensor]) -> tuple[int, int, int]:
    """(bytes copied, peak live bytes, live bytes at entry) for one call of ``fn``."""
    with CopiedBytes() as copied, LiveBytes(seed=seed) as live:
        entry = live.current
        fn()
    return copied.total, live.peak, entry


def _worker(rank: int, world: int, dim: int, ffn: int, steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    ref = Block(dim, ffn)
    names = [n for n, _ in ref.named_parameters()]
    full = [p.detach().clone() for p in ref.parameters()]
    shapes = [tuple(p.shape) for p in full]
    gen = torch.Generator().manual_seed(100 + rank)
    grads_in = [torch.randn(s, generator=gen) for s in shapes]

    # FSDP2, as users run it.
    fsdp_block = Block(dim, ffn)
    fsdp_block.load_state_dict(ref.state_dict())
    fully_shard(fsdp_block, mesh=mesh)
    state = fsdp_block._get_fsdp_state()  # type: ignore[operator]
    (group,) = state._fsdp_param_groups
    by_param = {id(fp.sharded_param): fp for fp in group.fsdp_params}
    fsdp_params = [by_param[id(p)] for p in fsdp_block.parameters()]  # our (module) order
    fsdp_seed = [fp._sharded_param_data for fp in fsdp_params]
    # One real step initialises FSDP2's lazy state (streams, comm context) as in training.
    fsdp_block(torch.randn(2, 8, dim)).sum().backward()
    fsdp_block.zero_grad(set_to_none=True)

    # DBuffer: the same shapes; row blocks (a 2-D weight is never cut inside a row).
    blocks = [s[-1] if len(s) == 2 else 1 for s in shapes]
    layout = contiguous_layout([torch.Size(s).numel() for s in shapes], world, blocks=blocks)
    params = load_full_(DBuffer(layout, shapes, mesh, names=names), full)
    grads = params.new_like()

    def fsdp_gather() -> None:
        fsdp_block.unshard()  # type: ignore[operator]
        fsdp_block.reshard()  # type: ignore[operator]

    def ours_gather() -> None:
        params.unshard()
        params.reshard()

    def fsdp_prepare_grads() -> None:
        fsdp_block.zero_grad(set_to_none=True)  # else post_backward accumulates into .grad
        fsdp_block.unshard()  # type: ignore[operator]
        for fp, g in zip(fsdp_params, grads_in, strict=True):
            fp.unsharded_param.grad = g.clone()

    def fsdp_reduce() -> None:
        group.post_backward()
        group.comm_ctx.reduce_scatter_states.clear()

    def ours_prepare_grads() -> None:
        for view, g in zip(grads.alloc_unsharded(), grads_in, strict=True):
            view.copy_(g)

    def ours_reduce() -> None:
        grads.reduce_scatter(op="avg")

    times: dict[str, list[float]] = {k: [] for k in ("fsdp_ag", "ours_ag", "fsdp_rs", "ours_rs")}
    for step in range(steps + 3):
        # Alternate which side goes first, so drift hits both alike.
        order = [("fsdp", fsdp_gather), ("ours", ours_gather)]
        for side, fn in order if step % 2 == 0 else order[::-1]:
            t = _barrier_time(fn)
            if step >= 3:
                times[f"{side}_ag"].append(t)
        order_rs = [
            ("fsdp", fsdp_prepare_grads, fsdp_reduce),
            ("ours", ours_prepare_grads, ours_reduce),
        ]
        for side, prepare, fn in order_rs if step % 2 == 0 else order_rs[::-1]:
            prepare()
            t = _barrier_time(fn)
            if step >= 3:
                times[f"{side}_rs"].append(t)
        group._training_state = type(group._training_state).IDLE

    # Correctness: both paths produce the same values.
    fsdp_block.unshard()  # type: ignore[operator]
    params.unshard()
    for fp, view in zip(fsdp_params, params.full_views(), strict=True):
        torch.testing.assert_close(fp.unsharded_param.detach(), view, rtol=0, atol=0)
    fsdp_block.reshard()  # type: ignore[operator]
    params.reshard()
    fsdp_sharded_grads = [p.grad.full_tensor() for p in fsdp_block.parameters()]  # type: ignore[union-attr]
    grads.unshard()
    for name, a, b in zip(names, fsdp_sharded_grads, grads.full_views(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"gradient {name} differs")
    grads.reshard()

    # Bytes copied and peak live bytes, one more call each outside the timing.
    out: dict[str, Any] = {}
    out["fsdp_ag"] = _measure(fsdp_gather, fsdp_seed)
    out["ours_ag"] = _measure(ours_gather, [params.shard])
    fsdp_prepare_grads()
    unsharded_grads = [g for fp in fsdp_params if (g := fp.unsharded_param.grad) is not None]
    fsdp_block.reshard()  # type: ignore[operator]  # as after backward: params already freed
    out["fsdp_rs"] = _measure(fsdp_reduce, [*fsdp_seed, *unsharded_grads])
    del unsharded_grads
    group._training_state = type(group._training_state).IDLE
    ours_prepare_grads()
    out["ours_rs"] = _measure(ours_reduce, [params.shard, grads.shard, grads.unsharded])
    # What gloo's reduce-scatter copies by itself (same for both sides, per its output size).
    backend: dict[str, int] = {}
    for side, numel in (
        ("ours", grads.shard_size),
        ("fsdp", sum(fp._sharded_param_data.numel() for fp in fsdp_params)),
    ):
        with CopiedBytes() as copied:
            dist.reduce_scatter_single(torch.empty(numel), torch.zeros(world * numel))
        backend[side] = copied.total
    return {
        "rank": rank,
        "times": times,
        "measures": out,
        "backend_rs_copies": backend,
        "param_bytes": sum(t.numel() * 4 for t in full),
        "dbuffer_shard_size": params.shard_size,
        "fsdp_padded_shard": sum(fp._sharded_param_data.numel() for fp in fsdp_params),
    }


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("results"), help="output folder")
    args = parser.parse_args()
    world = 2
    results = run_processes(_worker, world, args.dim, args.ffn, args.steps, timeout=900)
    r0 = results[0]
    rows = []
    summary: dict[str, Any] = {
        "world_size": world,
        "dim": args.dim,
        "ffn": args.ffn,
        "steps": args.steps,
        "param_bytes": r0["param_bytes"],
        "torch": torch.__version__,
        "dbuffer_shard_size": r0["dbuffer_shard_size"],
        "fsdp_padded_shard_size": r0["fsdp_padded_shard"],
        "paths": {},
    }
    for path, label in (("ag", "all-gather (+ reshard)"), ("rs", "reduce-scatter (avg)")):
        fsdp_t, ours_t = r0["times"][f"fsdp_{path}"], r0["times"][f"ours_{path}"]
        entry: dict[str, Any] = {}
        for side, ts in (("fsdp2", fsdp_t), ("dbuffer", ours_t)):
            key = f"{'fsdp' if side == 'fsdp2' else 'ours'}_{path}"
            copied, peak, entry_bytes = r0["measures"][key]
            backend = r0["backend_rs_copies"]["fsdp" if side == "fsdp2" else "ours"]
            entry[side] = {
                "median_ms": 1e3 * statistics.median(ts),
                "min_ms": 1e3 * min(ts),
                "bytes_copied": copied,
                "bytes_copied_by_backend": backend if path == "rs" else 0,
                "peak_live_bytes": peak,
                "live_bytes_at_entry": entry_bytes,
            }
        entry["time_ratio_median"] = entry["dbuffer"]["median_ms"] / entry["fsdp2"]["median_ms"]
        entry["time_ratio_min"] = entry["dbuffer"]["min_ms"] / entry["fsdp2"]["min_ms"]
        # Steps are paired (same iteration, alternating order): the median of per-step ratios
        # is the least noisy figure on a shared machine.
        entry["time_ratio_paired_median"] = statistics.median(
            o / f for f, o in zip(fsdp_t, ours_t, strict=True)
        )
        summary["paths"][path] = entry
        for side in ("fsdp2", "dbuffer"):
            e = entry[side]
            layer_copies = e["bytes_copied"] - e["bytes_copied_by_backend"]
            rows.append(
                f"| {label} | {side} | {e['median_ms']:.2f} | {e['min_ms']:.2f} | "
                f"{_mib(layer_copies)} | {_mib(e['bytes_copied_by_backend'])} | "
                f"{_mib(e['peak_live_bytes'])} | {_mib(e['live_bytes_at_entry'])} |"
            )
        rows.append(
            f"| {label} | **ratio dbuffer/fsdp2** (paired {entry['time_ratio_paired_median']:.2f}) "
            f"| {entry['time_ratio_median']:.2f} | {entry['time_ratio_min']:.2f} | | | | |"
        )
    print(
        f"DBuffer vs FSDP2, one LLaMA-like block (dim {args.dim}, ffn {args.ffn}, "
        f"{_mib(r0['param_bytes'])} MiB fp32 params), world size {world}, gloo, "
        f"{args.steps} steps, rank 0"
    )
    print()
    print(
        "| path | impl | median ms | min ms | MiB copied (layer) | MiB copied (gloo itself) | "
        "peak live MiB | live MiB at entry |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_dbuffer.json"
    path.write_text(json.dumps({"summary": summary, "per_rank": results}, indent=1) + "\n")
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
