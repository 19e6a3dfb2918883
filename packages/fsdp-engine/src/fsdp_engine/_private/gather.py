"""How a group's unsharded parameters are filled: one strategy, chosen when the group is set up
or reconfigured, never a flag tested per call.

[Note: all-gather strategies]
- ``ShardIsUnsharded``: one rank, no cast, no quantization: the unsharded parameters are views
  of the shard itself (nothing to gather, nothing to copy).
- ``LocalCast``: one rank with mixed precision: one cast of the shard into the compute-dtype
  storage (no collective, as FSDP2 on one rank).
- ``BufferGather``: the default: one all-gather of the shard (cast once to the compute dtype on
  the all-gather stream) straight into the unsharded storage whose slices are the parameters;
  a user all-gather (``set_custom_all_gather``) runs in its place, on the same stream.
- ``QuantizedBufferGather``: one packed all-gather of codes, scales and unquantized values,
  dequantized into the compute-dtype storage ([Note: quantized all-gather of a group]).
- ``PlacedCopyOut``: wraps one of the above for a placed group: the gathered buffer is in
  FSDP2's rank-major order, so each parameter has its own storage, filled by one copy after
  the gather ([Note: placed groups]); the gathered buffer is freed after the copy unless a
  post-forward part will be cut from it.
- ``PostForwardPart`` (``reshard_after_forward=k``): after forward, keep this rank's 1/k part of
  the gathered buffer; backward rebuilds it with one all-gather inside a sub-group of k ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import AllGatherComm, DBuffer, Handle
from fsdp_engine._private import compat
from fsdp_engine._private.quantized_gather import QuantizedGather
from fsdp_engine._private.storage import ShardStorage

__all__ = [
    "BufferGather",
    "PlacedCopyOut",
    "Gather",
    "LocalCast",
    "PostForwardPart",
    "QuantizedBufferGather",
    "ShardIsUnsharded",
    "choose_gather",
    "event_now",
]


def event_now(device: torch.device) -> torch.Event | None:
    """An event marking how far ``device``'s current stream has got (None without streams)."""
    if device.type in {"cpu", "meta"}:
        return None
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


class Gather:
    """A group's way to fill its unsharded parameters (module Note)."""

    def __init__(
        self, storage: ShardStorage, gather_dtype: torch.dtype, compute_dtype: torch.dtype
    ) -> None:
        self.storage = storage
        self.buffer: DBuffer = storage.buffer
        self.gather_dtype = gather_dtype
        self.compute_dtype = compute_dtype

    def views(self) -> Sequence[torch.Tensor]:
        """The full-shaped compute-dtype tensors the unsharded parameters wrap (their memory
        exists between ``issue`` and ``release``; asked once per unsharded parameter)."""
        full = self.storage.full_views(self.buffer, self.gather_dtype)
        return [v.view(self.compute_dtype) for v in full]

    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        """Start filling the unsharded storage; None when it is already complete."""
        raise NotImplementedError

    def complete(self) -> None:
        """After the handle completed: anything left to do on the caller's stream."""

    def flat(self) -> torch.Tensor:
        """The gathered flat buffer (gather dtype): what a post-forward part is cut from."""
        return self.buffer.unsharded_flat(self.gather_dtype)

    def release(self) -> None:
        """Free the unsharded memory (views stay valid objects)."""
        self.buffer.reshard()


class ShardIsUnsharded(Gather):
    def views(self) -> Sequence[torch.Tensor]:
        shapes = self.storage.shapes
        return [self.storage.local(i).view(shape) for i, shape in enumerate(shapes)]

    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        return None

    def release(self) -> None:
        pass  # the shard is the unsharded storage


class LocalCast(Gather):
    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        self.buffer.alloc_unsharded(dtype=self.gather_dtype)
        unsharded = self.buffer.unsharded_flat(self.gather_dtype)
        with compat.no_grad_and_preserved(unsharded):
            unsharded.copy_(self.buffer.shard)
        return None


class BufferGather(Gather):
    def __init__(
        self,
        storage: ShardStorage,
        gather_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        comm: AllGatherComm | None = None,
    ) -> None:
        super().__init__(storage, gather_dtype, compute_dtype)
        self.comm = comm

    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        return self.buffer.unshard(
            dtype=self.gather_dtype, async_op=async_op, ready=ready, comm=self.comm
        )


class QuantizedBufferGather(Gather):
    def __init__(
        self,
        storage: ShardStorage,
        gather_dtype: torch.dtype,
        compute_dtype: torch.dtype,
        quantized: QuantizedGather,
    ) -> None:
        super().__init__(storage, gather_dtype, compute_dtype)
        self.quantized = quantized

    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        return self.quantized.unshard(
            self.buffer, dtype=self.gather_dtype, async_op=async_op, ready=ready
        )


class PlacedCopyOut(Gather):
    """[Note: placed groups]: each parameter's own storage, filled from the gathered buffer by
    one copy (allocated again after a reshard: the same tensor, so autograd's saved references
    stay valid, and its version counter is kept like the buffer's views)."""

    def __init__(self, inner: Gather, *, keep_gathered: bool) -> None:
        super().__init__(inner.storage, inner.gather_dtype, inner.compute_dtype)
        self.inner = inner
        self.keep_gathered = keep_gathered
        device, dtype = self.buffer.device, self.compute_dtype
        self._full = [torch.empty(s, dtype=dtype, device=device) for s in self.storage.shapes]
        for full in self._full:
            full.untyped_storage().resize_(0)

    def views(self) -> Sequence[torch.Tensor]:
        return self._full

    def issue(self, *, ready: torch.Event | None, async_op: bool) -> Handle | None:
        return self.inner.issue(ready=ready, async_op=async_op)

    def complete(self) -> None:
        self.inner.complete()
        placed = self.storage.placed
        assert placed is not None
        flat = self.inner.flat().view(self.compute_dtype)
        for i, full in enumerate(self._full):
            storage = full.untyped_storage()
            nbytes = full.numel() * full.element_size()
            if storage.nbytes() < nbytes:
                storage.resize_(nbytes)
            with compat.no_grad_and_preserved(full):
                placed.copy_out(flat, i, full)
        if not self.keep_gathered:  # FSDP2 frees its copy too
            self.inner.release()

    def flat(self) -> torch.Tensor:
        return self.inner.flat()

    def release(self) -> None:
        self.inner.release()
        for full in self._full:
            full.untyped_storage().resize_(0)


def choose_gather(
    storage: ShardStorage,
    *,
    gather_dtype: torch.dtype,
    compute_dtype: torch.dtype,
    quantized: QuantizedGather | None,
    comm: AllGatherComm | None,
    keep_gathered: bool,
) -> Gather:
    """The group's strategy ([Note: all-gather strategies])."""
    if quantized is not None and comm is not None:
        names = list(storage.buffer.names)
        raise ValueError(
            f"fully_shard: set_custom_all_gather and MixedPrecisionPolicy("
            f"quantized_all_gather=...) both replace the all-gather of group {names}; use one "
            f"of them"
        )
    gather: Gather
    if quantized is not None:  # one rank still quantizes: the same weights as m ranks
        gather = QuantizedBufferGather(storage, gather_dtype, compute_dtype, quantized)
    elif storage.world == 1 and compute_dtype == storage.dtype and storage.materialized:
        return ShardIsUnsharded(storage, gather_dtype, compute_dtype)
    elif storage.world == 1:
        gather = LocalCast(storage, gather_dtype, compute_dtype)
    else:
        gather = BufferGather(storage, gather_dtype, compute_dtype, comm)
    if storage.copies:
        return PlacedCopyOut(gather, keep_gathered=keep_gathered)
    return gather


# (mesh, k) -> (the mesh's process group, the sub-group): equal meshes of another process
# group (a new world) do not share the entry
_SUBGROUPS: dict[tuple[DeviceMesh, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def _subgroup(mesh: DeviceMesh, k: int) -> dist.ProcessGroup:
    """The process group of this rank's k consecutive ranks of ``mesh``: one per (mesh, k),
    shared by every group (a communicator each would cost setup time and memory)."""
    parent = mesh.get_group()
    entry = _SUBGROUPS.get((mesh, k))
    if entry is None or entry[0] is not parent:
        world = mesh.size()
        ranks = mesh.mesh.flatten()
        sub = DeviceMesh(mesh.device_type, ranks.view(world // k, k))
        entry = _SUBGROUPS[(mesh, k)] = (parent, sub.get_group(1))
    return entry[1]


class PostForwardPart:
    """[Note: resharding to a sub-group]
    With k ranks per sub-group (consecutive coordinates of the shard axis), each rank keeps the
    k-th part of the unsharded flat buffer that its position in the sub-group names (m*S/k
    elements, so the sub-group holds the whole buffer), and backward rebuilds the buffer with
    one all-gather inside the sub-group: less memory than keeping it (k > 1), cheaper
    communication than a full reshard (k < m), e.g. k = ranks per node."""

    def __init__(self, mesh: DeviceMesh, k: int, rank: int) -> None:
        world = mesh.size()
        if world % k:
            raise ValueError(f"reshard_after_forward={k} must divide the shard-axis size {world}")
        if mesh.ndim != 1:
            raise NotImplementedError("reshard_after_forward as an int with HSDP is not supported")
        self.k = k
        self.group = _subgroup(mesh, k)
        self.index = rank % k
        self.chunk: torch.Tensor | None = None
        self.ready: torch.Event | None = None

    @property
    def held(self) -> bool:
        return self.chunk is not None

    def keep(self, flat: torch.Tensor) -> None:
        """Post-forward: keep this rank's 1/k part of the gathered ``flat`` (a copy)."""
        part = flat.numel() // self.k
        start = self.index * part
        self.chunk = flat[start : start + part].clone()
        self.ready = event_now(self.chunk.device)

    def regather(self, buffer: DBuffer, dtype: torch.dtype, *, async_op: bool) -> Handle:
        """Rebuild the gathered buffer from the kept parts: one all-gather inside the sub-group,
        asynchronous like any unshard, so backward prefetches it too."""
        chunk, ready = self.chunk, self.ready
        assert chunk is not None
        self.chunk = self.ready = None  # the handle holds it until the gather completes
        return buffer.gather_into(chunk, self.group, dtype=dtype, async_op=async_op, ready=ready)

    def drop(self) -> None:
        self.chunk = self.ready = None
