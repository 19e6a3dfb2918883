"""The collectives of a DBuffer: all-gather into its unsharded storage, reduce-scatter out of it.

[Note: version counters]
The all-gather refills memory that autograd may have saved (a weight saved for backward, freed
after forward, gathered again before backward). The values are the same parameters, so the
refill is done under ``_unsafe_preserve_version_counter`` exactly like FSDP2's copy-out; the
tensors' version counters do not move and backward accepts the saved views. An async gloo
all-gather bumps its output's counter when it completes, in the background (seen on real
processes), so the counter is put back when the handle is waited, not only around the issue.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import attrs
import torch
import torch.distributed as dist
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from dbuffer._private import streams
from dbuffer._private.collectives import (
    AllGatherComm,
    Handle,
    ReduceScatterComm,
    all_gather_flat,
    reduce_scatter_flat,
)
from dbuffer._private.reduction import ReduceSpec, avg_supported, reduce_spec
from dbuffer._private.storage import Unsharded

if TYPE_CHECKING:
    from dbuffer._private.buffer import DBuffer

__all__ = ["gather_into", "mesh_group", "reduce_scatter", "spec_for", "unshard"]

# per mesh object (by identity: equal meshes may hold other groups), dropped with the mesh; kept
# outside the buffers so a copied buffer copies no process group
_MESH_GROUPS: dict[int, dict[int, dist.ProcessGroup]] = {}


def mesh_group(buffer: DBuffer, axis: int) -> dist.ProcessGroup:
    """The process group of ``buffer``'s mesh axis ``axis`` (``get_group`` costs per call, and
    it is asked for on every collective)."""
    mesh = buffer.mesh
    groups = _MESH_GROUPS.get(id(mesh))
    if groups is None:
        groups = _MESH_GROUPS[id(mesh)] = {}
        weakref.finalize(mesh, _MESH_GROUPS.pop, id(mesh), None)
    group = groups.get(axis)
    if group is None:
        group = groups[axis] = mesh.get_group(axis)
    return group


def _gather_into_entry(
    buffer: DBuffer,
    entry: Unsharded,
    source: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    async_op: bool,
    ready: torch.Event | None,
    prepare: Callable[[], torch.Tensor] | None = None,
    after: Callable[[], None] | None = None,
    keep: Sequence[torch.Tensor] = (),
    comm: AllGatherComm | None = None,
) -> Handle:
    """Allocate ``entry`` on the all-gather stream (after ``ready``), optionally ``prepare`` the
    input there, and gather into it with the version counter kept."""
    device = buffer.device
    stream = streams.comm_stream_for(device, "all_gather")
    streams.ordered_after(stream, device, ready)
    with streams.on_stream(stream), _unsafe_preserve_version_counter(entry.flat):
        entry.allocate()
        if prepare is not None:
            source = prepare()
    guard = _unsafe_preserve_version_counter(entry.flat)

    def finish() -> None:
        if after is not None:
            after()
        guard.__exit__(None, None, None)

    with guard:
        handle = all_gather_flat(
            entry.flat,
            source,
            group,
            async_op=async_op,
            finish=finish,
            keep=keep,
            ordered=True,
            comm=comm,
        )
    return buffer._track(handle)


def unshard(
    buffer: DBuffer,
    *,
    dtype: torch.dtype | None,
    async_op: bool,
    ready: torch.Event | None,
    comm: AllGatherComm | None = None,
) -> Handle:
    """``DBuffer.unshard``: one all-gather of the shard (cast once to ``dtype`` on the
    all-gather stream when it differs) into the unsharded storage of ``dtype``."""
    if dtype is not None and dtype.is_floating_point != buffer.dtype.is_floating_point:
        raise ValueError(
            f"DBuffer.unshard: dtype {dtype} for a {buffer.dtype} buffer would "
            f"truncate values; mixed precision needs a floating dtype"
        )
    buffer._require_shard("unshard")
    buffer.wait()
    entry = buffer._unsharded_of(dtype)
    size = buffer.shard_size

    def cast_in_place() -> torch.Tensor:
        """[Note: a cast all-gathered in place]: this rank's shard cast straight into its own
        slot of the output, which is the all-gather's input (FSDP2's all-gather input is also a
        slice of its output): no temporary shard-sized buffer."""
        mine = entry.flat[buffer.rank * size : (buffer.rank + 1) * size]
        mine.copy_(buffer.shard)
        return mine

    cast = entry.flat.dtype != buffer.dtype
    return _gather_into_entry(
        buffer,
        entry,
        buffer.shard,
        mesh_group(buffer, buffer.shard_axis),
        async_op=async_op,
        ready=ready,
        prepare=cast_in_place if cast else None,
        comm=comm,
    )


def gather_into(
    buffer: DBuffer,
    source: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    dtype: torch.dtype | None,
    async_op: bool,
    ready: torch.Event | None,
) -> Handle:
    """``DBuffer.gather_into``: ``source`` over ``group`` into the unsharded storage."""
    buffer.wait()
    entry = buffer._unsharded_of(dtype)
    if source.dtype != entry.flat.dtype:
        raise ValueError(
            f"DBuffer.gather_into: source is {source.dtype}, the storage {entry.flat.dtype}"
        )
    return _gather_into_entry(
        buffer, entry, source, group, async_op=async_op, ready=ready, keep=(source,)
    )


def spec_for(
    buffer: DBuffer,
    op: str,
    reduce_dtype: torch.dtype,
    *,
    divide_factor: float | None = None,
    force_sum: bool = False,
) -> ReduceSpec:
    """The arithmetic of a reduction of ``buffer`` ([Note: dividing a mean of gradients]):
    ``op`` "sum" or "avg", the backend's ``AVG`` capability read for the buffer's device on
    every group the reduction uses."""
    if op not in ("sum", "avg"):
        raise ValueError(f"reduce op must be 'sum' or 'avg', got {op!r}")
    groups = [mesh_group(buffer, a) for a in (buffer.shard_axis, *buffer.replicate_axes)]
    replicas = 1
    for axis in buffer.replicate_axes:
        replicas *= buffer.mesh.size(axis)
    return reduce_spec(
        reduce_dtype,
        buffer.world_size,
        replicas,
        mean=op == "avg",
        divide_factor=divide_factor,
        force_sum=force_sum,
        avg=all(avg_supported(g, buffer.device) for g in groups),
    )


def reduce_scatter(
    buffer: DBuffer,
    *,
    spec: ReduceSpec,
    reduce_dtype: torch.dtype | None,
    accumulate: bool,
    into: DBuffer | None,
    free_unsharded: bool,
    async_op: bool,
    hook: Callable[[torch.Tensor], None] | None = None,
    hook_stream: torch.Stream | None = None,
    comm: ReduceScatterComm | None = None,
    allocate: Callable[..., torch.Tensor] | None = None,
    partial: torch.Tensor | None = None,
    hold: torch.Tensor | None = None,
    shard_group: dist.ProcessGroup | None = None,
) -> Handle:
    """``DBuffer.reduce_scatter``: the unsharded storage reduced into ``into``'s shard.

    HSDP microbatches without the replica all-reduce (FSDP2's ``set_requires_all_reduce
    (False)``): ``hold`` (a shard-sized tensor in the reduce dtype) receives the reduce-scatter's
    result instead (added with ``accumulate``; no all-reduce, post-division or hook), and the
    next full reduction adds it back before its all-reduce (``partial``). ``shard_group``: the
    reduce-scatter on another process group over the shard axis' ranks (FSDP2's
    ``set_separate_reduce_scatter_group``). ``Handle.wait_input`` waits only until the input has
    been read ([Note: two events per reduction])."""
    target = buffer if into is None else into
    if into is not None:
        buffer._require_same(into, "reduce_scatter")
    if hold is None:
        target._require_shard("reduce_scatter")
    if not buffer.is_unsharded():
        raise RuntimeError(
            "DBuffer.reduce_scatter: the unsharded storage is not allocated "
            "(call alloc_unsharded() and let autograd write the gradients)"
        )
    entry = buffer._unsharded_of(buffer.dtype)

    def release() -> None:
        entry.release()
        buffer._detach_grads()

    buffer.wait()
    if target is not buffer:
        target.wait()
    out = target.shard
    replicas = [mesh_group(buffer, a) for a in buffer.replicate_axes]
    if hold is not None:
        if hold.numel() != buffer.shard_size:
            raise ValueError(
                f"DBuffer.reduce_scatter: hold has {hold.numel()} elements, the shard "
                f"{buffer.shard_size}"
            )
        out, replicas, hook = hold, [], None
        spec = attrs.evolve(spec, post_divide=None)
    return buffer._track(
        reduce_scatter_flat(
            out,
            entry.flat,
            mesh_group(buffer, buffer.shard_axis) if shard_group is None else shard_group,
            replicas,
            spec=spec,
            reduce_dtype=reduce_dtype,
            accumulate=accumulate,
            async_op=async_op,
            hook=hook,
            hook_stream=hook_stream,
            comm=comm,
            allocate=allocate,
            partial=partial,
            release_input=release if free_unsharded else None,
        )
    )
