"""A packed all-gather: each rank's bytes of several dtypes (codes, then scales) in one buffer.

[Note: the packed byte layout]
A quantized all-gather moves, for every rank, a few *segments* of different dtypes whose sizes
differ from rank to rank (one byte per code, four per fp32 scale, two per bf16 value of a tensor
that is not quantized). One collective needs equal per-rank sizes, so every rank contributes a
*section* of ``B`` bytes: segment ``j`` of rank ``k`` starts at ``offsets[k][j]`` inside rank
``k``'s section, segments follow each other in order, each start rounded up to ``align`` bytes,
and ``B`` is the largest rank's end rounded up to ``align``. With ``align = 16`` every segment can
be viewed as any dtype (every element size divides 16) and the per-rank size is 16-byte aligned
(what NCCL wants). After the gather rank ``k``'s section is bytes ``[k B, (k + 1) B)`` of the
receive buffer. The layout is a pure function of the sizes, so ranks that agree on the sizes
agree on every offset; ``PackedAllGather`` checks that they do before the first collective.

[Note: the packed all-gather of a DBuffer]
``PackedAllGather.unshard`` fills the buffer's unsharded storage of a dtype like
``DBuffer.unshard``, but through bytes: ``encode(send)`` writes this rank's section (e.g. its
shard, quantized), one all-gather moves every section, and ``decode(recv, out)`` writes the
unsharded flat tensor ``out`` from all of them (e.g. dequantized). On an accelerator all three
run on the all-gather stream after the shard's ``ready`` event, like ``DBuffer.unshard``'s cast,
so a prefetch quantizes and dequantizes off the compute stream; the send and receive buffers are
that stream's temporaries, released when the handle completes ([Note: streams and frees without
record_stream]). ``out``'s version counter is left as it was ([Note: version counters]).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from dbuffer._private import streams
from dbuffer._private.agreement import check_agreement
from dbuffer._private.buffer import DBuffer
from dbuffer._private.collectives import Handle

__all__ = ["PackedAllGather", "PackedLayout", "packed_layout"]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@attrs.frozen
class PackedLayout:
    """Where each rank's segments lie in its section of a packed all-gather
    ([Note: the packed byte layout]). Build it with ``packed_layout``.

    ``sizes[k][j]`` and ``offsets[k][j]``: bytes and start (inside rank k's section) of rank k's
    segment j; ``section_bytes``: ``B``, what every rank sends.
    """

    sizes: tuple[tuple[int, ...], ...]
    offsets: tuple[tuple[int, ...], ...]
    section_bytes: int
    align: int

    @property
    def world_size(self) -> int:
        return len(self.sizes)

    @property
    def fingerprint(self) -> str:
        """Equal on two ranks exactly when their layouts are equal."""
        text = repr((self.sizes, self.align))
        return "packed:" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def segment(
        self, data: torch.Tensor, rank: int, j: int, dtype: torch.dtype, *, gathered: bool = True
    ) -> torch.Tensor:
        """Rank ``rank``'s segment ``j`` of the byte tensor ``data`` as a 1-D ``dtype`` view.

        ``data`` is the receive buffer (``gathered``: all sections) or one section (the send
        buffer). The segment's bytes must be a whole number of ``dtype`` elements.
        """
        start = (rank * self.section_bytes if gathered else 0) + self.offsets[rank][j]
        size = self.sizes[rank][j]
        itemsize = torch.empty((), dtype=dtype).element_size()
        if size % itemsize:
            raise ValueError(
                f"PackedLayout.segment: rank {rank}'s segment {j} has {size} bytes, not a whole "
                f"number of {dtype} elements ({itemsize} bytes)"
            )
        return data[start : start + size].view(dtype)


def packed_layout(sizes: Sequence[Sequence[int]], *, align: int = 16) -> PackedLayout:
    """The packed layout of per-rank segment sizes in bytes (``sizes[k][j]``: rank k's
    segment j); each segment starts at a multiple of ``align`` bytes inside its section."""
    if align < 1:
        raise ValueError(f"packed_layout: align must be >= 1 byte, got {align}")
    if not sizes:
        raise ValueError("packed_layout: sizes needs one entry per rank, got none")
    all_sizes: list[tuple[int, ...]] = []
    all_offsets: list[tuple[int, ...]] = []
    end = 0
    for k, rank_sizes in enumerate(sizes):
        offsets = []
        cursor = 0
        for j, size in enumerate(rank_sizes):
            if size < 0:
                raise ValueError(f"packed_layout: rank {k}'s segment {j} has {size} bytes")
            cursor = _round_up(cursor, align)
            offsets.append(cursor)
            cursor += size
        all_sizes.append(tuple(int(s) for s in rank_sizes))
        all_offsets.append(tuple(offsets))
        end = max(end, cursor)
    # a section of at least one alignment unit: collectives of zero bytes are not portable
    section = max(align, _round_up(end, align))
    return PackedLayout(tuple(all_sizes), tuple(all_offsets), section, align)


class PackedAllGather:
    """One all-gather of byte sections into a DBuffer's unsharded storage
    ([Note: the packed all-gather of a DBuffer]).

    Args:
        buffer: the DBuffer whose unsharded storage ``unshard`` fills (gathered over its shard
            axis).
        layout: the sections' layout; ``layout.world_size`` must be the shard axis' size.
        check: compare the layout across every rank of the mesh now (a mismatch raises
            ``LayoutMismatchError`` on every rank instead of aborting the first collective).
    """

    def __init__(self, buffer: DBuffer, layout: PackedLayout, *, check: bool = True) -> None:
        if layout.world_size != buffer.world_size:
            raise ValueError(
                f"PackedAllGather: the layout has sections for {layout.world_size} ranks, the "
                f"buffer's shard axis has {buffer.world_size}"
            )
        self.buffer = buffer
        self.layout = layout
        if check:
            check_agreement(
                buffer.mesh,
                {
                    "packed layout fingerprint": layout.fingerprint,
                    "section bytes": str(layout.section_bytes),
                },
                what="packed all-gather",
            )

    def unshard(
        self,
        encode: Callable[[torch.Tensor], None],
        decode: Callable[[torch.Tensor, torch.Tensor], None],
        *,
        dtype: torch.dtype,
        async_op: bool = False,
        ready: torch.Event | None = None,
        after: Callable[[torch.Tensor], None] | None = None,
    ) -> Handle:
        """Allocate the buffer's unsharded storage of ``dtype``, ``encode(send)`` this rank's
        section (``section_bytes`` uint8), all-gather every section into ``recv``
        (``world_size * section_bytes`` uint8) and ``decode(recv, out)`` into the flat
        unsharded tensor ``out``. One collective (none on one rank: ``recv`` is ``send``).

        Streams as for ``DBuffer.unshard`` ([Note: streams and frees without record_stream]):
        on an accelerator the buffers are allocated, and ``encode``, the collective and
        ``decode`` run, on the all-gather stream after ``ready``; on CPU an asynchronous
        gather decodes when the handle is waited. ``after(recv)`` runs in ``wait`` on the
        caller's stream (after the collective is ordered before it): e.g. a user hook reading
        the codes."""
        buffer = self.buffer
        buffer._require_shard("unshard")
        buffer.wait()  # the shard may still be written by a collective of this buffer
        world = buffer.world_size
        device = buffer.device
        entry = buffer._unsharded_of(dtype)
        out = entry.flat
        section = self.layout.section_bytes
        stream = streams.comm_stream_for(device, "all_gather")
        streams.ordered_after(stream, device, ready)
        with streams.on_stream(stream):
            entry.allocate()
            send = torch.empty(section, dtype=torch.uint8, device=device)
            recv = send
            if world > 1:
                recv = torch.empty(section * world, dtype=torch.uint8, device=device)
            with torch.no_grad():
                encode(send)
        defer = async_op and stream is None and world > 1  # gloo: decode once the work is done
        works: list[dist.Work] = []

        def run_decode() -> None:
            with torch.no_grad():
                decode(recv, out)

        # the version counter is put back when the handle is waited (see [Note: version
        # counters]): an async gloo gather bumps it in the background
        guard = _unsafe_preserve_version_counter(out)
        with guard, streams.on_stream(stream):
            if world > 1:
                group = buffer.mesh.get_group(buffer.shard_axis)
                streams.collective_starts("all_gather", stream)
                work = dist.all_gather_single(recv, send, group=group, async_op=defer)
                if defer and work is not None:
                    works.append(work)
            if not defer:
                run_decode()
            end = None if stream is None else streams.event_after(stream, device)

        def finish() -> None:
            if defer:
                run_decode()
            guard.__exit__(None, None, None)
            if after is not None:
                after(recv)  # reads recv (the all-gather stream's memory) on the caller's stream

        # recv and send go back to the all-gather stream's pool after the caller's reads
        handle = Handle(
            works,
            event=end,
            finish=finish,
            keep=(send, recv, out),
            owners=() if stream is None else (stream,),
            device=device,
        )
        if not async_op:
            handle.wait()
        return buffer._track(handle)
