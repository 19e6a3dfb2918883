"""FSDP2's ``Shard(d)`` from ``shard_placement_fn``: one parameter per group, FSDP2's layout.

[Note: Shard(d) groups]
A parameter that ``shard_placement_fn`` puts on ``Shard(d)`` gets a group of its own, laid out
as FSDP2 lays it out, so the sharded parameter is a plain DTensor with FSDP2's placement, shape
and local tensor. ``Shard(0)``: the tensor in row-major order, each rank's shard
``ceil(D / m)`` rows (DTensor's chunking: the last ranks may hold fewer rows or none), so the
unsharded parameter is still a view of the gathered buffer. ``Shard(d > 0)``: the buffer stores
the tensor *chunk-major*: for a tensor of shape ``(..., D, ...)`` split
into ``m`` equal chunks of ``c = D / m`` along dim ``d``, the buffer is
``X.reshape(pre, m, c, post).transpose(0, 1)`` flattened (``pre``/``post``: the products of the
sizes before/after ``d``). Rank r's shard is then exactly chunk r, contiguous, which is
``Shard(d)``'s local tensor, so the sharded parameter is a plain DTensor with FSDP2's placement
and shape. The gathered buffer is chunk-major, not the tensor's row-major order, and no strided
view maps one onto the other (index k of dim d lands in chunk ``k // c`` at ``k % c``), so the
unsharded parameter is a separate tensor filled by one copy after the all-gather, and its
gradient is copied back into chunk-major order before the reduce-scatter: FSDP2's copy-out and
copy-in, for these parameters only. Every other parameter keeps the zero-copy planned layout.
FSDP2 itself refuses an uneven dim > 0, and so do we (``api._with_placement_fn``).
"""

from __future__ import annotations

import math

import torch

from shard_planner import Plan

__all__ = ["shard_dim_plan", "chunk_shape", "from_chunk_major", "local_chunk", "to_chunk_major"]


def _split(shape: tuple[int, ...], dim: int, world: int) -> tuple[int, int, int]:
    """``(pre, c, post)``: the sizes before dim, one chunk of dim, and after dim."""
    size = shape[dim]
    if size % world:
        raise ValueError(f"dim {dim} of shape {shape} does not split into {world} equal chunks")
    return math.prod(shape[:dim]), size // world, math.prod(shape[dim + 1 :])


def chunk_shape(shape: tuple[int, ...], dim: int, world: int) -> tuple[int, ...]:
    """The shape of one rank's chunk (``Shard(dim)``'s local tensor)."""
    return (*shape[:dim], shape[dim] // world, *shape[dim + 1 :])


def shard_dim_plan(name: str, shape: tuple[int, ...], dim: int, world: int) -> Plan:
    """The one-tensor plan whose shard r is ``Shard(dim)``'s chunk r: ``ceil(D / m)`` whole
    rows for dim 0 (padding at the end), one even chunk-major chunk for dim > 0."""
    numel = math.prod(shape)
    row = math.prod(shape[1:])
    if dim == 0:
        per_rank, block = -(-shape[0] // world) * row, max(1, row)
    else:
        per_rank = numel // world
        block = max(1, per_rank)
    return Plan(
        world_size=world,
        shard_size=max(1, per_rank),
        align=1,
        numels=(numel,),
        blocks=(block,),
        names=(name,),
        offsets=(0,),
        order=(0,),
        method="shard-dim",
    )


def local_chunk(full: torch.Tensor, dim: int, world: int, index: int) -> torch.Tensor:
    """Chunk ``index`` of ``full`` along ``dim``, flattened (a copy when it is not contiguous)."""
    pre, c, post = _split(tuple(full.shape), dim, world)
    return full.reshape(pre, world, c, post)[:, index].reshape(-1)


def to_chunk_major(full: torch.Tensor, out: torch.Tensor, dim: int, world: int) -> None:
    """Write ``full`` (its own shape) into the flat ``out`` in chunk-major order."""
    pre, c, post = _split(tuple(full.shape), dim, world)
    out.view(world, pre, c, post).copy_(full.reshape(pre, world, c, post).transpose(0, 1))


def from_chunk_major(flat: torch.Tensor, out: torch.Tensor, dim: int, world: int) -> None:
    """Write the chunk-major ``flat`` into ``out`` (the tensor's shape, row-major)."""
    pre, c, post = _split(tuple(out.shape), dim, world)
    out.view(pre, world, c, post).copy_(flat.view(world, pre, c, post).transpose(0, 1))
