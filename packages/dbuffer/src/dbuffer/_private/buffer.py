"""``DBuffer``: one flat sharded storage per group, zero-copy views, one collective per group.

[Note: storage lifetime]
A DBuffer allocates, once and for the whole group, a shard storage of S elements (persistent)
and an unsharded tensor of m * S elements whose storage is empty except between ``unshard`` and
``reshard``. Freeing is ``untyped_storage().resize_(0)`` and re-allocation ``resize_(nbytes)``: the
storage *object* never changes, so every view made once (full tensors, autograd's saved tensors,
``.grad`` views) keeps pointing at it across release and re-allocation, and the memory is returned
when ``reshard`` returns -- deterministically, not when a caching allocator decides. Views are
made once and reused every step.

[Note: version counters]
The all-gather refills memory that autograd may have saved (a weight saved for backward, freed
after forward, gathered again before backward). The values are the same parameters, so the
refill is done under ``_unsafe_preserve_version_counter`` exactly like FSDP2's copy-out; the
tensors' version counters do not move and backward accepts the saved views.
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from collections.abc import Iterable, Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from dbuffer._private.agreement import check_agreement
from dbuffer._private.collectives import (
    Handle,
    ReduceOp,
    all_gather_flat,
    note_free,
    order_all_gather,
    reduce_scatter_flat,
)
from dbuffer._private.layout import BufferLayout, TensorSlot, slots_for
from dbuffer._private.refs import Claim

__all__ = ["DBuffer"]

Part = Literal["shard", "unsharded"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on ``mesh``: its device type, the current index for accelerators."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device(kind)
    return torch.device(kind, torch.get_device_module(kind).current_device())


def _spec(
    mesh: DeviceMesh, placements: tuple[Placement, ...], slot: TensorSlot, dtype: torch.dtype
) -> DTensorSpec:
    """The DTensor spec of tensor ``slot``'s shard view, built once per buffer layout and dtype.

    ``slots_for`` has already checked everything ``DTensor.from_local`` would check for a
    RaggedShard (units per rank, the unit dividing the tensor, this rank's share), so the spec is
    built directly: ``from_local``'s checks cost a Python step per rank (thousands at scale).
    """
    meta = TensorMeta(torch.Size(slot.shape), slot.stride, dtype)
    return DTensorSpec(mesh, placements, tensor_meta=meta)


def _dtensor_view(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor over ``local`` (no copy: its local tensor *is* ``local``), as DTensor's own
    no-autograd constructors build it."""
    return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]


def _on(stream: torch.Stream | None) -> contextlib.AbstractContextManager[object]:
    """``stream`` as the current stream for the block (nothing on CPU)."""
    return contextlib.nullcontext() if stream is None else stream


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def _allocate(tensor: torch.Tensor) -> bool:
    """Give ``tensor``'s storage its full size again; True if it had been freed."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() == nbytes:
        return False
    storage.resize_(nbytes)
    return True


class _Unsharded:
    """An unsharded flat tensor of one dtype with its full views, made once."""

    def __init__(self, buffer: DBuffer, dtype: torch.dtype) -> None:
        size = buffer.shard_size * buffer.world_size
        self.flat = torch.empty(size, dtype=dtype, device=buffer.device)
        self.views = tuple(
            self.flat[s.offset : s.offset + s.numel].view(s.shape) for s in buffer.slots
        )
        # A low-precision shard: the shard cast once, the all-gather's input (released after use).
        self.cast_shard = (
            None
            if dtype == buffer.dtype
            else torch.empty(buffer.shard_size, dtype=dtype, device=buffer.device)
        )
        _free(self.flat)
        if self.cast_shard is not None:
            _free(self.cast_shard)

    @property
    def allocated(self) -> bool:
        return self.flat.untyped_storage().nbytes() != 0


class DBuffer:
    """A distributed flat buffer: a group of tensors laid out in one flat storage, sharded over
    one mesh axis.

    Args:
        layout: any object satisfying ``BufferLayout`` (the planner's ``Plan``, or
            ``contiguous_layout(...)``): S elements per rank and each tensor's flat range.
        shapes: each tensor's shape, in the layout's order.
        mesh: the device mesh. The buffer is sharded over ``shard_axis`` (default: the last axis)
            and replicated over every other axis (HSDP: axis 0 replicate, axis 1 shard).
        dtype: the dtype of the storage.
        names: names used in error messages (default ``tensor[i]``).
        check: compare the layout across all ranks of the mesh now (a mismatch raises
            ``LayoutMismatchError`` on every rank instead of aborting a later collective).

    The shard storage is ``shard`` (S elements, zero-initialised); ``sharded_views()`` are the
    tensors' shards as ``RaggedShard`` DTensors whose local tensors are views of it.
    ``unshard()`` all-gathers into ``unsharded`` (m * S elements), whose slices ``full_views()``
    are the full tensors; ``reshard()`` frees it.
    """

    def __init__(
        self,
        layout: BufferLayout,
        shapes: Sequence[Sequence[int]],
        mesh: DeviceMesh,
        *,
        dtype: torch.dtype = torch.float32,
        names: Sequence[str] | None = None,
        shard_axis: int = -1,
        check: bool = True,
    ) -> None:
        if not isinstance(layout, BufferLayout):
            raise TypeError(
                f"layout {type(layout).__name__} does not satisfy dbuffer.BufferLayout "
                f"(shard_size, world_size, offsets, numels, fingerprint, "
                f"local_units(i))"
            )
        self.layout = layout
        self.mesh = mesh
        self.dtype = dtype
        self.device = mesh_device(mesh)
        axis = shard_axis % mesh.ndim if -mesh.ndim <= shard_axis < mesh.ndim else None
        if axis is None:
            raise ValueError(f"shard_axis {shard_axis} is not an axis of the {mesh.ndim}-D mesh")
        self.shard_axis = axis
        self.replicate_axes = tuple(a for a in range(mesh.ndim) if a != axis)
        self.world_size = mesh.size(axis)
        if int(layout.world_size) != self.world_size:
            raise ValueError(
                f"layout is for world_size {layout.world_size} but mesh axis {axis} "
                f"has {self.world_size} ranks"
            )
        self.rank = mesh.get_local_rank(axis)
        self.shard_size = int(layout.shard_size)
        self.names = (
            tuple(names) if names is not None else tuple(f"tensor[{i}]" for i in range(len(shapes)))
        )
        self.slots: tuple[TensorSlot, ...] = slots_for(layout, shapes, self.names, self.rank)
        self.shapes = tuple(s.shape for s in self.slots)
        self._placements = tuple(self._placements_of(slot) for slot in self.slots)
        self._specs: dict[torch.dtype, tuple[DTensorSpec, ...]] = {}
        if check:
            check_agreement(mesh, self._record(), what="DBuffer")
        self._make_storage()

    def _make_storage(self) -> None:
        """The per-buffer state: shard storage (zeroed), its views, nothing unsharded yet."""
        self.shard = torch.zeros(self.shard_size, dtype=self.dtype, device=self.device)
        # made on first use: a buffer that only ever holds a shard (e.g. sharded gradients)
        # never touches m * S elements
        self._unsharded: dict[torch.dtype, _Unsharded] = {}
        self._local_views = tuple(self.shard[s.local_start : s.local_stop] for s in self.slots)
        self._sharded_views: tuple[DTensor, ...] | None = None
        self._grad_owners: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = []
        self._inflight: list[Handle] = []
        self._claim: Claim | None = None

    # -- identity -------------------------------------------------------------------------------
    def _record(self) -> dict[str, str]:
        shapes = hashlib.sha256(repr(self.shapes).encode()).hexdigest()[:16]
        return {
            "layout fingerprint": str(self.layout.fingerprint),
            "shard_size": str(self.shard_size),
            "dtype": str(self.dtype),
            "shapes digest": shapes,
            "number of tensors": str(len(self.slots)),
        }

    def same_layout(self, other: DBuffer) -> bool:
        """True if ``other`` lays out the same tensors the same way on the same mesh."""
        return (
            self.mesh == other.mesh
            and self.shard_axis == other.shard_axis
            and self.shard_size == other.shard_size
            and self.shapes == other.shapes
            and [s.offset for s in self.slots] == [s.offset for s in other.slots]
        )

    def _require_same(self, other: DBuffer, op: str) -> None:
        if not self.same_layout(other):
            raise ValueError(
                f"DBuffer.{op}: the other buffer has a different layout, shapes or "
                f"mesh (shard size {other.shard_size} vs {self.shard_size})"
            )

    def new_like(self, dtype: torch.dtype | None = None) -> DBuffer:
        """A zeroed buffer with the same layout (gradients, optimizer states); no re-check.

        The layout's derived geometry (slots, placements, specs) is shared, not derived again:
        making one costs one allocation and a view per tensor, whatever the world size."""
        out = DBuffer.__new__(DBuffer)
        for name in (
            "layout",
            "mesh",
            "device",
            "shard_axis",
            "replicate_axes",
            "world_size",
            "rank",
            "shard_size",
            "names",
            "slots",
            "shapes",
            "_placements",
            "_specs",  # shared dict: specs per dtype, built once for the layout
        ):
            setattr(out, name, getattr(self, name))
        out.dtype = dtype or self.dtype
        out._make_storage()
        return out

    # -- views ----------------------------------------------------------------------------------
    def _placements_of(self, slot: TensorSlot) -> tuple[Placement, ...]:
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        placements[self.shard_axis] = slot.placement
        return tuple(placements)

    @property
    def placements(self) -> list[tuple[Placement, ...]]:
        """Each tensor's DTensor placements (Replicate on other axes, RaggedShard on the shard
        axis)."""
        return list(self._placements)

    def local_views(self) -> tuple[torch.Tensor, ...]:
        """This rank's share of each tensor: a 1-D view of ``shard`` (possibly empty)."""
        return self._local_views

    def specs(self) -> tuple[DTensorSpec, ...]:
        """Each tensor's DTensor spec for this buffer's dtype (shared by buffers of the layout)."""
        specs = self._specs.get(self.dtype)
        if specs is None:
            specs = tuple(
                _spec(self.mesh, placements, slot, self.dtype)
                for slot, placements in zip(self.slots, self._placements, strict=True)
            )
            self._specs[self.dtype] = specs
        return specs

    def sharded_views(self) -> tuple[DTensor, ...]:
        """Each tensor as a ``RaggedShard`` DTensor whose local tensor is a view of ``shard``.
        Made once; the same objects every call (and across ``release_shard``)."""
        if self._sharded_views is None:
            self._sharded_views = tuple(
                _dtensor_view(local, spec)
                for local, spec in zip(self._local_views, self.specs(), strict=True)
            )
        return self._sharded_views

    def _unsharded_of(self, dtype: torch.dtype | None) -> _Unsharded:
        dtype = dtype or self.dtype
        entry = self._unsharded.get(dtype)
        if entry is None:
            entry = self._unsharded[dtype] = _Unsharded(self, dtype)
        return entry

    @property
    def unsharded(self) -> torch.Tensor:
        """The flat unsharded tensor (m * S elements); its storage is empty while resharded."""
        return self._unsharded_of(self.dtype).flat

    def is_unsharded(self, dtype: torch.dtype | None = None) -> bool:
        entry = self._unsharded.get(dtype or self.dtype)
        return entry is not None and entry.allocated

    def full_views(
        self, dtype: torch.dtype | None = None, *, allow_released: bool = False
    ) -> tuple[torch.Tensor, ...]:
        """Each tensor's full value (original shape), a view of the unsharded storage of
        ``dtype`` (default: the buffer's dtype). The same tensor objects every call.

        Their data exists only between ``unshard``/``alloc_unsharded`` and ``reshard``: reading
        a view of released storage is undefined (torch does not check), so this raises while the
        storage is released unless ``allow_released`` (to set up views or hooks ahead of time).
        """
        entry = self._unsharded_of(dtype)
        if not allow_released and not entry.allocated:
            raise RuntimeError(
                f"DBuffer.full_views: the {entry.flat.dtype} unsharded storage is released "
                f"(call unshard() first, or pass allow_released=True to get the views anyway)"
            )
        return entry.views

    # -- allocation -----------------------------------------------------------------------------
    def unsharded_flat(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The flat unsharded tensor of ``dtype`` (m * S elements; empty storage while
        released). For callers that fill it themselves, e.g. a gather over a sub-group."""
        return self._unsharded_of(dtype).flat

    def alloc_unsharded(
        self, *, zero: bool = False, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Allocate the unsharded storage of ``dtype`` (default: the buffer's; one allocation for
        the group) without gathering, e.g. for gradients; ``zero`` fills it with zeros (one
        kernel). Returns ``full_views(dtype)``."""
        entry = self._unsharded_of(dtype)
        _allocate(entry.flat)
        if zero:
            with _unsafe_preserve_version_counter(entry.flat):
                entry.flat.zero_()
        return entry.views

    def reshard(self) -> None:
        """Free every unsharded storage (all dtypes). Views stay valid objects; their memory is
        released now and re-allocated by the next ``unshard``/``alloc_unsharded``. A collective
        still in flight on this buffer is waited for first (never free memory under it)."""
        self.wait()
        if any(entry.allocated for entry in self._unsharded.values()):
            # the all-gather stream's next allocation waits for every read issued so far
            note_free(self.device)
        for entry in self._unsharded.values():
            _free(entry.flat)
            if entry.cast_shard is not None:
                _free(entry.cast_shard)
        self._detach_grads()

    def _detach_grads(self) -> None:
        # A .grad that is a view of released storage would crash whoever reads it next.
        for ref, view in self._grad_owners:
            param = ref()
            if param is not None and param.grad is view:
                param.grad = None
        self._grad_owners = []

    # -- the shard storage between uses (see [Note: releasing a storage ...] in refs.py) ---------
    def claim_views(self, extra: Iterable[torch.Tensor] = ()) -> None:
        """Record the references to the shard storage and to its views that exist now as this
        buffer's own: the shard, its local views, its sharded views if made, and ``extra``
        (tensors the caller built over the shard and keeps). Call once they are all made and
        none is handed out; ``release_shard`` then frees in place only while no other reference
        was added. ``extra`` is consumed here: pass a generator (or a temporary), not a list the
        caller keeps, so that the count holds only the references that last."""
        objects = (self.shard, *self._local_views, *(self._sharded_views or ()), *extra)
        del extra
        claim = Claim(self.shard, objects)
        del objects
        claim.mark()  # here, not in Claim(): the arguments of that call hold references
        self._claim = claim

    def views_held_elsewhere(self) -> bool:
        """True if anything beyond the claimed references holds the shard storage or one of its
        views (a tensor a user kept), or if nothing was claimed."""
        return self._claim is None or not self._claim.unchanged()

    def release_shard(self) -> bool:
        """Free the shard storage in place, keeping the storage object and every view, if no
        reference beyond the claimed ones exists; True if freed. ``alloc_shard`` re-allocates:
        the same views then see the new memory (its values are undefined until written)."""
        if self.views_held_elsewhere():
            return False
        self.wait()
        _free(self.shard)
        return True

    def alloc_shard(self, *, zero: bool = False) -> None:
        """Give the shard storage its memory back after ``release_shard`` (a no-op if it has
        it); ``zero`` fills it with zeros."""
        if _allocate(self.shard) and zero:
            with _unsafe_preserve_version_counter(self.shard):
                self.shard.zero_()

    @property
    def shard_allocated(self) -> bool:
        return self.shard.untyped_storage().nbytes() != 0

    def _require_shard(self, op: str) -> None:
        if not self.shard_allocated:
            raise RuntimeError(
                f"DBuffer.{op}: the shard storage is released (call alloc_shard() first)"
            )

    # -- collectives ----------------------------------------------------------------------------
    def _group(self, axis: int) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)

    def unshard(
        self,
        *,
        dtype: torch.dtype | None = None,
        async_op: bool = False,
        ready: torch.Event | None = None,
    ) -> Handle:
        """All-gather the shard into the unsharded storage: one collective for the group.

        With ``dtype`` different from the buffer's (mixed precision), the shard is cast once into
        a temporary low-precision shard (released when the gather completes) and the cast is
        gathered into a low-precision unsharded storage; ``full_views(dtype)`` read it.
        On an accelerator the output is allocated and the cast run on the all-gather stream,
        which waits for ``ready`` (the event marking the shard's last write; default: the
        caller's stream now) and for the last free ([Note: streams and frees without
        record_stream] in collectives.py).
        """
        if dtype is not None and dtype.is_floating_point != self.dtype.is_floating_point:
            raise ValueError(
                f"DBuffer.unshard: dtype {dtype} for a {self.dtype} buffer would "
                f"truncate values; mixed precision needs a floating dtype"
            )
        self._require_shard("unshard")
        self.wait()
        entry = self._unsharded_of(dtype)
        stream = order_all_gather(self.device, ready)
        cast = entry.cast_shard
        with _on(stream):
            _allocate(entry.flat)
            source = self.shard
            if cast is not None:
                _allocate(cast)
                cast.copy_(self.shard)
                source = cast
        # An async gloo all-gather bumps its output's version counter when it completes, in the
        # background (seen on real processes): the counter is put back when the handle is
        # waited, not only around the issue (see [Note: version counters]).
        guard = _unsafe_preserve_version_counter(entry.flat)

        def finish() -> None:
            if cast is not None:
                _free(cast)
            guard.__exit__(None, None, None)

        with guard:
            handle = all_gather_flat(
                entry.flat,
                source,
                self._group(self.shard_axis),
                async_op=async_op,
                finish=finish,
                ordered=stream is not None,
            )
        return self._track(handle)

    def gather_into(
        self,
        source: torch.Tensor,
        group: dist.ProcessGroup,
        *,
        dtype: torch.dtype | None = None,
        async_op: bool = False,
        ready: torch.Event | None = None,
    ) -> Handle:
        """All-gather ``source`` over ``group`` into the unsharded storage of ``dtype`` (its size
        times the group's must be m * S), e.g. a part kept after forward regathered within a
        sub-group. Like ``unshard``: output allocated on the all-gather stream after ``ready``
        (the event marking ``source``'s last write); ``source`` is held until the handle
        completes."""
        self.wait()
        entry = self._unsharded_of(dtype)
        if source.dtype != entry.flat.dtype:
            raise ValueError(
                f"DBuffer.gather_into: source is {source.dtype}, the storage {entry.flat.dtype}"
            )
        stream = order_all_gather(self.device, ready)
        with _on(stream):
            _allocate(entry.flat)
        guard = _unsafe_preserve_version_counter(entry.flat)

        def finish() -> None:
            guard.__exit__(None, None, None)

        with guard:
            handle = all_gather_flat(
                entry.flat,
                source,
                group,
                async_op=async_op,
                finish=finish,
                keep=(source,),
                ordered=stream is not None,
            )
        return self._track(handle)

    def _track(self, handle: Handle) -> Handle:
        if not handle.done:
            self._inflight.append(handle)
        return handle

    def wait(self) -> None:
        """Wait for every collective of this buffer still in flight (a no-op when none is)."""
        pending, self._inflight = self._inflight, []
        for handle in pending:
            handle.wait()

    def reduce_scatter(
        self,
        *,
        op: ReduceOp = "sum",
        reduce_dtype: torch.dtype | None = None,
        accumulate: bool = False,
        into: DBuffer | None = None,
        free_unsharded: bool = True,
        async_op: bool = False,
    ) -> Handle:
        """Reduce the unsharded storage over the mesh into the shard: one reduce-scatter over the
        shard axis, then (HSDP) one all-reduce over each replicate axis.

        Writes ``into.shard`` (default: this buffer's ``shard``); ``accumulate`` adds to it.
        ``op="avg"`` divides by the number of ranks of the whole mesh. ``reduce_dtype`` runs the
        collectives in that dtype. ``free_unsharded`` releases the unsharded storage when the
        handle completes.
        """
        target = self if into is None else into
        if into is not None:
            self._require_same(into, "reduce_scatter")
        target._require_shard("reduce_scatter")
        if not self.is_unsharded():
            raise RuntimeError(
                "DBuffer.reduce_scatter: the unsharded storage is not allocated "
                "(call alloc_unsharded() and let autograd write the gradients)"
            )
        flat = self._unsharded_of(self.dtype).flat

        def release() -> None:
            _free(flat)
            self._detach_grads()

        finish = release if free_unsharded else None
        self.wait()
        if target is not self:
            target.wait()
        return self._track(
            reduce_scatter_flat(
                target.shard,
                flat,
                self._group(self.shard_axis),
                [self._group(a) for a in self.replicate_axes],
                op=op,
                reduce_dtype=reduce_dtype,
                accumulate=accumulate,
                async_op=async_op,
                finish=finish,
            )
        )

    # -- fused group ops (one kernel over the whole group) --------------------------------------
    def _flat(self, part: Part) -> torch.Tensor:
        self.wait()  # a collective in flight may be writing the storage
        if part == "shard":
            self._require_shard("shard op")
            return self.shard
        if part == "unsharded":
            if not self.is_unsharded():
                raise RuntimeError("DBuffer: the unsharded storage is not allocated")
            return self.unsharded
        raise ValueError(f"part must be 'shard' or 'unsharded', got {part!r}")

    def zero_(self, part: Part = "shard") -> DBuffer:
        self._flat(part).zero_()
        return self

    def scale_(self, factor: float, part: Part = "shard") -> DBuffer:
        self._flat(part).mul_(factor)
        return self

    def add_(self, other: DBuffer, *, alpha: float = 1.0, part: Part = "shard") -> DBuffer:
        self._require_same(other, "add_")
        self._flat(part).add_(other._flat(part), alpha=alpha)
        return self

    def copy_(self, other: DBuffer, part: Part = "shard") -> DBuffer:
        """Copy (and cast, if dtypes differ) ``other`` into this buffer."""
        self._require_same(other, "copy_")
        self._flat(part).copy_(other._flat(part))
        return self

    def to(self, dtype: torch.dtype) -> DBuffer:
        """A new buffer holding this one's shard cast to ``dtype`` (one kernel)."""
        out = self.new_like(dtype)
        out.shard.copy_(self.shard)
        return out

    # -- loading and checking tensors -----------------------------------------------------------
    def check_tensors(
        self, tensors: Sequence[torch.Tensor], *, full: bool = True, what: str = "tensor"
    ) -> None:
        """Raise ``ValueError`` naming the first tensor whose numel, dtype or device does not
        match the layout (``full``: whole tensors; else this rank's local shares)."""
        if len(tensors) != len(self.slots):
            raise ValueError(f"DBuffer: got {len(tensors)} {what}s for {len(self.slots)} slots")
        for slot, tensor in zip(self.slots, tensors, strict=True):
            expected = slot.numel if full else slot.local_numel
            where = f"{what} {slot.name!r} (index {slot.index})"
            if tensor.numel() != expected:
                raise ValueError(
                    f"{where}: has {tensor.numel()} elements (shape "
                    f"{tuple(tensor.shape)}), the layout expects {expected}"
                    f"{'' if full else ' on rank ' + str(self.rank)}"
                )
            if tensor.dtype != self.dtype:
                raise ValueError(f"{where}: dtype {tensor.dtype}, the buffer holds {self.dtype}")
            if tensor.device != self.device:
                raise ValueError(
                    f"{where}: on device {tensor.device}, the buffer lives on {self.device}"
                )

    @torch.no_grad()
    def load_full_(self, tensors: Sequence[torch.Tensor]) -> DBuffer:
        """Copy this rank's share of each full tensor into the shard (initialisation)."""
        self.check_tensors(tensors, full=True)
        self.wait()
        for slot, local, tensor in zip(self.slots, self._local_views, tensors, strict=True):
            flat = tensor.reshape(-1)
            local.copy_(flat[slot.tensor_start : slot.tensor_start + slot.local_numel])
        return self

    def attach_grads(self, params: Sequence[torch.Tensor]) -> None:
        """Make each ``params[i].grad`` the full view ``i`` of this (gradient) buffer, so
        autograd accumulates gradients in place into the unsharded storage. The storage must be
        allocated (``alloc_unsharded(zero=True)``). When the storage is released (``reshard`` or
        a ``reduce_scatter`` that frees it), those ``.grad`` are reset to None."""
        self.check_tensors(params, full=True, what="parameter")
        if not self.is_unsharded():
            raise RuntimeError("DBuffer.attach_grads: allocate the unsharded storage first")
        for param, view in zip(params, self.full_views(), strict=True):
            if tuple(param.shape) != tuple(view.shape):
                raise ValueError(
                    f"parameter shape {tuple(param.shape)} differs from the "
                    f"layout's {tuple(view.shape)}"
                )
            param.grad = view
            self._grad_owners.append((weakref.ref(param), view))

    @property
    def nbytes(self) -> int:
        """Bytes of the persistent shard storage."""
        return self.shard_size * self.shard.element_size()

    def __repr__(self) -> str:
        return (
            f"DBuffer({len(self.slots)} tensors, shard_size={self.shard_size}, "
            f"world_size={self.world_size}, dtype={self.dtype}, mesh={self.mesh}, "
            f"unsharded={self.is_unsharded()})"
        )
