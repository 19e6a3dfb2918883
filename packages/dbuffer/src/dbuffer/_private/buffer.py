"""``DBuffer``: one flat sharded storage per group, zero-copy views, one collective per group.

The shard storage is persistent; the unsharded storages exist only between ``unshard`` (or
``alloc_unsharded``) and ``reshard`` ([Note: storage lifetime] in storage.py). The collectives
are in ``buffer_comm.py`` ([Note: version counters]) and ``collectives.py``; the stream rules
in ``streams.py``.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement

from dbuffer._private import buffer_comm
from dbuffer._private.agreement import check_agreement
from dbuffer._private.collectives import AllGatherComm, Handle, ReduceScatterComm
from dbuffer._private.fused import FusedOps
from dbuffer._private.geometry import BufferGeometry
from dbuffer._private.layout import BufferLayout
from dbuffer._private.reduction import Op as ReduceOp
from dbuffer._private.reduction import ReduceSpec
from dbuffer._private.refs import Claim, ReleasableShard
from dbuffer._private.storage import Unsharded

__all__ = ["DBuffer"]


class DBuffer(FusedOps, ReleasableShard):
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

    The shard storage is ``shard`` (S elements, zero-initialised); ``local_views()`` are the
    tensors' shares of it and ``specs()`` their ``RaggedShard`` DTensor specs (a DTensor over a
    local view with its spec is the tensor's shard, no copy).
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
        device: torch.device | None = None,
        zero: bool = True,
    ) -> None:
        geometry = BufferGeometry(
            layout, shapes, mesh, names=names, shard_axis=shard_axis, device=device
        )
        if check:
            check_agreement(mesh, geometry.record(dtype), what="DBuffer")
        self._init(geometry, dtype, zero=zero)

    def _init(self, geometry: BufferGeometry, dtype: torch.dtype, *, zero: bool) -> None:
        """The per-buffer state: shard storage (zeroed unless ``zero=False``: memory reserved,
        not written), its views, nothing unsharded yet."""
        self.geometry = geometry
        g = geometry
        self.layout, self.mesh, self.device, self.names = g.layout, g.mesh, g.device, g.names
        self.shard_axis, self.replicate_axes = g.shard_axis, g.replicate_axes
        self.world_size, self.rank, self.shard_size = g.world_size, g.rank, g.shard_size
        self.slots, self.shapes = g.slots, g.shapes
        self.dtype = dtype
        make = torch.zeros if zero else torch.empty
        self.shard = make(self.shard_size, dtype=dtype, device=self.device)
        # made on first use: a buffer that only ever holds a shard (e.g. sharded gradients)
        # never touches m * S elements
        self._unsharded: dict[torch.dtype, Unsharded] = {}
        self._local_views = tuple(self.shard[s.local_start : s.local_stop] for s in self.slots)
        # made by dbuffer.testing's sharded_views / attach_grads (kept here: the shard's
        # release counts the views as the buffer's own, a release of the unsharded storage
        # resets the attached .grad)
        self._sharded_views: tuple[DTensor, ...] | None = None
        self._grad_owners: list[tuple[weakref.ref[torch.Tensor], torch.Tensor]] = []
        self._inflight: list[Handle] = []
        self._claim: Claim | None = None

    def new_like(
        self,
        dtype: torch.dtype | None = None,
        *,
        zero: bool = True,
        device: torch.device | None = None,
    ) -> DBuffer:
        """A buffer with the same layout (gradients, optimizer states); no re-check. Zeroed
        unless ``zero=False`` (reserved, not written); on ``device`` if given (e.g. a buffer made
        on ``meta`` at setup, given memory when materialized). The geometry (slots, placements,
        specs) is shared: making one costs one allocation and a view per tensor, whatever the
        world size."""
        geometry = self.geometry if device is None else self.geometry.on(torch.device(device))
        out = DBuffer.__new__(DBuffer)
        out._init(geometry, dtype or self.dtype, zero=zero)
        return out

    # -- views ----------------------------------------------------------------------------------
    @property
    def placements(self) -> list[tuple[Placement, ...]]:
        """Each tensor's DTensor placements (Replicate on other axes, RaggedShard on the shard
        axis)."""
        return list(self.geometry.placements)

    def local_views(self) -> tuple[torch.Tensor, ...]:
        """This rank's share of each tensor: a 1-D view of ``shard`` (possibly empty)."""
        return self._local_views

    def specs(self) -> tuple[DTensorSpec, ...]:
        """Each tensor's DTensor spec for this buffer's dtype (shared by buffers of the layout)."""
        return self.geometry.specs(self.dtype)

    def _unsharded_of(self, dtype: torch.dtype | None) -> Unsharded:
        dtype = dtype or self.dtype
        entry = self._unsharded.get(dtype)
        if entry is None:
            entry = self._unsharded[dtype] = Unsharded(
                self.shard_size * self.world_size, self.slots, dtype, self.device
            )
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
        entry.allocate()
        if zero:
            with _unsafe_preserve_version_counter(entry.flat):
                entry.flat.zero_()
        return entry.views

    def reshard(self) -> None:
        """Free every unsharded storage (all dtypes). Views stay valid objects; their memory is
        released now and re-allocated by the next ``unshard``/``alloc_unsharded``. A collective
        still in flight on this buffer is waited for first (never free memory under it)."""
        self.wait()
        for entry in self._unsharded.values():
            entry.release()  # its pool's stream waits for our reads first (streams.py)
        self._detach_grads()

    def _detach_grads(self) -> None:
        # A .grad that is a view of released storage would crash whoever reads it next.
        for ref, view in self._grad_owners:
            param = ref()
            if param is not None and param.grad is view:
                param.grad = None
        self._grad_owners = []

    # -- collectives (buffer_comm.py) -----------------------------------------------------------
    def unshard(
        self,
        *,
        dtype: torch.dtype | None = None,
        async_op: bool = False,
        ready: torch.Event | None = None,
        comm: AllGatherComm | None = None,
    ) -> Handle:
        """All-gather the shard into the unsharded storage: one collective for the group.

        With ``dtype`` different from the buffer's (mixed precision), the shard is cast once into
        a temporary low-precision shard (released when the gather completes) and the cast is
        gathered into a low-precision unsharded storage; ``full_views(dtype)`` read it.
        On an accelerator the output is allocated and the cast run on the all-gather stream,
        which waits for ``ready`` (the event marking the shard's last write; default: the
        caller's stream now) ([Note: streams and frees without record_stream] in streams.py).
        ``comm``: a user all-gather run in place of the backend's.
        """
        return buffer_comm.unshard(self, dtype=dtype, async_op=async_op, ready=ready, comm=comm)

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
        return buffer_comm.gather_into(
            self, source, group, dtype=dtype, async_op=async_op, ready=ready
        )

    def _track(self, handle: Handle) -> Handle:
        if not handle.done:
            self._inflight.append(handle)
        return handle

    def wait(self) -> None:
        """Wait for every collective of this buffer still in flight (a no-op when none is)."""
        pending, self._inflight = self._inflight, []
        for handle in pending:
            handle.wait()

    def reduce_spec(
        self,
        op: ReduceOp = "avg",
        reduce_dtype: torch.dtype | None = None,
        *,
        divide_factor: float | None = None,
        force_sum: bool = False,
    ) -> ReduceSpec:
        """The arithmetic ``reduce_scatter`` uses for ``op`` in ``reduce_dtype`` on this buffer's
        mesh and device, FSDP2's ([Note: dividing a mean of gradients] in reduction.py):
        ``divide_factor`` divides by that instead of the number of ranks, ``force_sum`` makes
        every collective a SUM (the division is done before/after)."""
        return buffer_comm.spec_for(
            self,
            op,
            reduce_dtype or self.dtype,
            divide_factor=divide_factor,
            force_sum=force_sum,
        )

    def reduce_scatter(
        self,
        *,
        op: ReduceOp = "sum",
        reduce_dtype: torch.dtype | None = None,
        accumulate: bool = False,
        into: DBuffer | None = None,
        free_unsharded: bool = True,
        async_op: bool = False,
        spec: ReduceSpec | None = None,
        hook: Callable[[torch.Tensor], None] | None = None,
        hook_stream: torch.Stream | None = None,
        comm: ReduceScatterComm | None = None,
        allocate: Callable[..., torch.Tensor] | None = None,
        partial: torch.Tensor | None = None,
        hold: torch.Tensor | None = None,
        shard_group: dist.ProcessGroup | None = None,
    ) -> Handle:
        """Reduce the unsharded storage over the mesh into the shard: one reduce-scatter over the
        shard axis (none when it has one rank), then (HSDP) one all-reduce over each replicate
        axis.

        Writes ``into.shard`` (default: this buffer's ``shard``); ``accumulate`` adds to it.
        ``op="avg"``: the mean over every rank of the mesh; ``spec`` (from ``reduce_spec``)
        gives the arithmetic explicitly instead. ``reduce_dtype`` runs the collectives in that
        dtype. ``free_unsharded`` releases the unsharded storage when the handle completes.
        ``hook(reduced)`` runs on the reduced shard (reduce dtype) after the replica all-reduce,
        on ``hook_stream`` if given; ``comm`` / ``allocate`` replace the backend's
        reduce-scatter and the receive buffer's allocation (FSDP2's custom reduce-scatter).
        ``hold`` / ``partial`` / ``shard_group``: ``buffer_comm.reduce_scatter``.
        """
        rdtype = reduce_dtype or self.dtype
        return buffer_comm.reduce_scatter(
            self,
            spec=spec if spec is not None else self.reduce_spec(op, rdtype),
            reduce_dtype=reduce_dtype,
            accumulate=accumulate,
            into=into,
            free_unsharded=free_unsharded,
            async_op=async_op,
            hook=hook,
            hook_stream=hook_stream,
            comm=comm,
            allocate=allocate,
            partial=partial,
            hold=hold,
            shard_group=shard_group,
        )

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
