"""The arithmetic of gradient means: FSDP2's rule, the backend's AVG capability (never its name),
and the reduce-scatter FSDP2 skips on a one-rank shard axis."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from dbuffer import DBuffer, ReduceSpec, contiguous_layout, reduce_spec
from ragged_dtensor.testing import run_processes, run_threaded


class _Sized:
    """Stands in for a process group where FSDP2's rule only asks its size."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def _fsdp2(
    dtype: torch.dtype, shard: int, replicas: int, factor: float | None, force_sum: bool
) -> ReduceSpec:
    """FSDP2's own decision (torch 2.13's ``_get_gradient_divide_factors``) in our terms."""
    pre, post, rs_op, ar_op = _get_gradient_divide_factors(
        _Sized(shard),  # type: ignore[arg-type]
        _Sized(replicas) if replicas > 1 else None,  # type: ignore[arg-type]
        dtype,
        "cpu",
        factor,
        force_sum,
    )

    def name(op: Any) -> str:
        if op == dist.ReduceOp.AVG:
            return "avg"
        if op == dist.ReduceOp.SUM:
            return "sum"
        return "premul"  # a PREMUL_SUM(1 / factor)

    scatter = name(rs_op)
    return ReduceSpec(
        scatter_op="sum" if scatter == "premul" else scatter,  # type: ignore[arg-type]
        all_reduce_op=name(ar_op),  # type: ignore[arg-type]
        pre_divide=None if pre in (None, 1) else float(pre),
        post_divide=None if post in (None, 1) else float(post),
        premul_factor=float(factor) if scatter == "premul" and factor is not None else None,
    )


@pytest.mark.parametrize(
    ("dtype", "shard", "replicas", "factor", "force_sum"),
    list(
        itertools.product(
            (torch.float32, torch.bfloat16, torch.float16, torch.float64),
            (1, 2, 3, 8),
            (1, 2),
            (None, 2.0, 3.0, 8.0),
            (False, True),
        )
    ),
)
def test_the_rule_is_fsdp2s(
    dtype: torch.dtype, shard: int, replicas: int, factor: float | None, force_sum: bool
) -> None:
    ours = reduce_spec(dtype, shard, replicas, divide_factor=factor, force_sum=force_sum, avg=True)
    assert ours == _fsdp2(dtype, shard, replicas, factor, force_sum)


def test_a_backend_without_avg_sums_and_divides() -> None:
    """FSDP2's rule for a backend whose collectives only sum (MTIA): SUM, then one division."""
    assert reduce_spec(torch.float32, 4, avg=False) == ReduceSpec(post_divide=4.0)
    assert reduce_spec(torch.float32, 1, avg=False) == ReduceSpec()


def _ops_on_compound_backend(rank: int, world: int) -> list[str]:
    """A 2-rank group made with a compound backend string (what ``init_process_group()`` gives
    on a GPU host, here gloo for both device types): the fp32 mean must use AVG, which the
    name compare ``get_backend(group) == "nccl"`` got wrong."""
    group = dist.new_group(list(range(world)), backend="cpu:gloo,cuda:gloo")
    assert dist.get_backend(group) not in ("gloo", "nccl")  # a compound name
    mesh = DeviceMesh.from_group(group, "cpu")
    buf = DBuffer(contiguous_layout([8], world), [(8,)], mesh)
    seen: list[str] = []
    real = dist.reduce_scatter_single

    def spy(*args: Any, op: Any = dist.ReduceOp.SUM, **kwargs: Any) -> Any:
        seen.append("avg" if op == dist.ReduceOp.AVG else "sum")
        return real(*args, op=op, **kwargs)

    dist.reduce_scatter_single = spy  # type: ignore[assignment]
    try:
        buf.alloc_unsharded()
        buf.unsharded.fill_(float(rank + 1))
        buf.reduce_scatter(op="avg")
    finally:
        dist.reduce_scatter_single = real
    assert torch.equal(buf.shard, torch.full_like(buf.shard, 1.5))
    return seen


def test_the_op_follows_capability_not_the_backend_name() -> None:
    assert run_processes(_ops_on_compound_backend, 2, timeout=60) == [["avg"], ["avg"]]


def _hsdp_one_rank_shard(rank: int, world: int) -> tuple[int, list[float]]:
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    buf = DBuffer(contiguous_layout([4], 1), [(4,)], mesh)
    calls = [0]
    real = dist.reduce_scatter_single

    def count(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.reduce_scatter_single = count  # type: ignore[assignment]
    try:
        buf.alloc_unsharded()
        buf.unsharded.fill_(float(rank))
        buf.reduce_scatter(op="avg")
    finally:
        dist.reduce_scatter_single = real
    return calls[0], buf.shard.tolist()


def test_a_one_rank_shard_axis_runs_no_reduce_scatter() -> None:
    """HSDP on a (replicas, 1) mesh: FSDP2 copies instead of reduce-scattering over one rank;
    so does the buffer, and the replica all-reduce still averages."""
    for calls, values in run_threaded(_hsdp_one_rank_shard, 2):
        assert calls == 0
        assert values == [0.5] * 4
