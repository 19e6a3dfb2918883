"""Helpers for the Shampoo / SOAP tests: run N steps sharded or not, compare with one device.

No tests here; module-level functions so that spawned gloo processes can import them by name.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from optim_support import Spec, local_of, ranges_of, shard
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import optim_blockwise as ob


def make(kind: str, params: list[Any], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
    if kind == "shampoo":
        return ob.Shampoo(params, **kwargs)
    if kind == "soap":
        return ob.SOAP(params, **kwargs)
    raise ValueError(kind)


def run(
    mesh: DeviceMesh | None,
    kind: str,
    shapes: list[tuple[int, ...]],
    specs: list[Spec],
    steps: int,
    kwargs: dict[str, Any],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """``steps`` steps on seeded data; per param its local value and state; the step stats."""
    torch.set_num_threads(1)  # same arithmetic on every side: one thread, set explicitly
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    params = [torch.nn.Parameter(shard(f, mesh, sp)) for f, sp in zip(fulls, specs, strict=True)]
    opt = make(kind, params, kwargs)
    stats = []
    for step in range(steps):
        for p, s, sp in zip(params, shapes, specs, strict=True):
            scale = 10.0 ** ((step % 3) - 1)  # magnitudes vary across steps
            p.grad = shard(torch.randn(s, generator=gen).mul(scale).to(dtype), mesh, sp)
        opt.step()
        stats.append(dict(opt.last_step_stats))  # type: ignore[attr-defined]
    records = []
    for p in params:
        record = {"param": local_of(p.detach()).clone()}
        for key, value in opt.state[p].items():
            if isinstance(value, torch.Tensor):
                record[key] = value.clone()
        records.append(record)
    return {"records": records, "stats": stats}


def dist_run(rank: int, world: int, *args: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    return run(mesh, *args)


def dist_run_bytes(rank: int, world: int, *args: Any) -> bytes:
    from optim_support import to_bytes

    return to_bytes(dist_run(rank, world, *args))


def check_equal_to_single(
    per_rank: list[dict[str, Any]],
    single: dict[str, Any],
    shapes: list[tuple[int, ...]],
    specs: list[Spec],
) -> None:
    """Bitwise: every rank's parameter and elementwise state is the single-device slice; every
    block's state is held by exactly one rank and equals the single-device block."""
    world = len(per_rank)
    for i, (shape, spec) in enumerate(zip(shapes, specs, strict=True)):
        want = single["records"][i]
        ranges = ranges_of(shape, spec, world)
        holders: dict[str, list[int]] = {}
        for rank in range(world):
            got = per_rank[rank]["records"][i]
            lo, hi = ranges[rank] if spec[0] != "plain" else (0, math.prod(shape))
            where = f"param {i} shape {shape} {spec[0]} rank {rank}"
            for key, value in got.items():
                if key.startswith("block"):
                    holders.setdefault(key, []).append(rank)
                    assert torch.equal(value, want[key]), f"{where}/{key}: not bit-identical"
                elif key == "step":
                    assert torch.equal(value, want[key]), f"{where}/step"
                else:
                    ref = want[key].reshape(-1)[lo:hi]
                    assert value.dtype == ref.dtype and torch.equal(value, ref), (
                        f"{where}/{key}: not bit-identical "
                        f"(max diff {(value.double() - ref.double()).abs().max().item():.3g})"
                        if value.numel() == ref.numel()
                        else f"{where}/{key}: {value.numel()} != {ref.numel()} elements"
                    )
        blocks = sorted(k for k in want if k.startswith("block"))
        assert sorted(holders) == blocks, f"param {i}: block keys {sorted(holders)} != {blocks}"
        for key, ranks in holders.items():
            assert len(ranks) == 1 or spec[0] == "plain", f"param {i}/{key} held by {ranks}"
