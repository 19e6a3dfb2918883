"""Which gradients a group reduces, by its trainable mask, and the compact layout of a subset.

[Note: frozen parameters] (reduce.py) says when each kind is used.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs
import torch

from dbuffer import DBuffer, contiguous_layout
from fsdp_engine._private.placed import PlacedLayout
from fsdp_engine._private.storage import ShardStorage

__all__ = [
    "Piece",
    "Reduction",
    "add_compact",
    "compact_buffer",
    "compact_pieces",
    "placed_compact_pieces",
    "reduction_for_mask",
]

Piece = tuple[
    int, int, int, int
]  # (tensor index, start inside the tensor, length, start in segment)


def compact_pieces(
    offsets: Sequence[int],
    numels: Sequence[int],
    shard_size: int,
    world: int,
    trainable: Sequence[bool],
    align: int,
) -> tuple[int, tuple[tuple[Piece, ...], ...]]:
    """The compact reduction layout of the trainable subset of a planned group.

    Rank r's shard of the parameter buffer is ``[r*S, (r+1)*S)``; tensor i occupies
    ``[off_i, off_i + n_i)``, so its piece on rank r is the intersection, of length
    ``max(0, min(off_i + n_i, (r+1)*S) - max(off_i, r*S))``. Segment r of the compact buffer holds
    the pieces of the trainable tensors on rank r, in tensor order, back to back; the segment size
    is ``S_g = max_r (sum of those lengths)`` rounded up to ``align``. A reduce-scatter of
    ``world`` segments then leaves on rank r exactly the trainable tensors' local shares, each a
    contiguous slice. Returns ``(S_g, pieces)`` with ``pieces[r]`` the ``(i, start in tensor,
    length, start in segment)`` of every trainable tensor on rank r (length 0 included, so every
    rank has a view for every trainable tensor).
    """
    by_rank: list[tuple[Piece, ...]] = []
    largest = 0
    for r in range(world):
        lo, hi = r * shard_size, (r + 1) * shard_size
        cursor = 0
        pieces: list[Piece] = []
        for i, (off, numel) in enumerate(zip(offsets, numels, strict=True)):
            if not trainable[i]:
                continue
            start, stop = max(off, lo), min(off + numel, hi)
            length = max(0, stop - start)
            pieces.append((i, start - off if length else 0, length, cursor))
            cursor += length
        largest = max(largest, cursor)
        by_rank.append(tuple(pieces))
    size = max(align, -(-largest // align) * align)
    return size, tuple(by_rank)


def placed_compact_pieces(
    placed: PlacedLayout, trainable: Sequence[bool], align: int
) -> tuple[int, tuple[tuple[Piece, ...], ...]]:
    """FSDP2's reduce-scatter input for the trainable ``Shard(0)`` members of a placed group:
    segment r holds each trainable parameter's padded chunk r (``chunks[i]`` elements, the
    first ``local_numel(i, r)`` of them its rows ``[r*c_i, ...)``, which start at
    ``r * chunks[i]`` in the flattened full gradient), back to back; frozen members take no
    bytes (a QLoRA block's frozen NF4 weights are neither reduced nor communicated)."""
    by_rank: list[tuple[Piece, ...]] = []
    cursor = 0
    for r in range(placed.world):
        cursor = 0
        pieces: list[Piece] = []
        for i, chunk in enumerate(placed.chunks):
            if not trainable[i]:
                continue
            length = placed.local_numel(i, r)
            pieces.append((i, r * chunk if length else 0, length, cursor))
            cursor += chunk
        by_rank.append(tuple(pieces))
    size = max(align, -(-cursor // align) * align)
    return size, tuple(by_rank)


@attrs.frozen
class Reduction:
    """How a group reduces its gradients for one trainable mask ([Note: frozen parameters])."""

    mask: tuple[bool, ...]
    kind: Literal["none", "full", "compact"]
    segment: int = 0  # compact: elements per rank
    pieces: tuple[tuple[Piece, ...], ...] = ()
    # compact: the compact buffer cut into its pieces and paddings, rank-major (``split`` sizes),
    # and per trainable tensor its pieces' lengths by rank and their slots in that cut
    cut: tuple[int, ...] = ()
    by_tensor: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = attrs.field(factory=dict)


def compact_buffer(
    storage: ShardStorage, segment: int, dtype: torch.dtype, *, zero: bool = True
) -> DBuffer:
    total = segment * storage.world
    return DBuffer(
        contiguous_layout([total], storage.world, align=1),
        [(total,)],
        storage.mesh,
        dtype=dtype,
        names=["trainable gradients"],
        shard_axis=storage.shard_axis,
        check=False,
        device=storage.device,
        zero=zero,
    )


def reduction_for_mask(storage: ShardStorage, mask: tuple[bool, ...], align: int) -> Reduction:
    """The reduction of ``mask``: none, full, or compact over the trainable subset."""
    if not any(mask):
        return Reduction(mask, "none")
    placed = storage.placed
    dims = () if placed is None else placed.dims
    shard0 = all(d == 0 for d, t in zip(dims, mask, strict=False) if t)
    if placed is not None and not all(mask) and shard0:
        # FSDP2's bytes: no alignment (the segments are never viewed as another dtype)
        segment, pieces = placed_compact_pieces(placed, mask, 1)
        return _compact_reduction(mask, segment, pieces)
    if all(mask) or placed is not None:
        # a placed group with a trainable Shard(d > 0) member reduces its frozen members' zeros
        # too ([Note: placed groups]): the trainable ones' values are the same, only frozen
        # ones get no .grad
        return Reduction(mask, "full")
    plan = storage.plan
    segment, pieces = compact_pieces(
        plan.offsets, plan.numels, plan.shard_size, storage.world, mask, align
    )
    return _compact_reduction(mask, segment, pieces)


def _compact_reduction(
    mask: tuple[bool, ...], segment: int, pieces: tuple[tuple[Piece, ...], ...]
) -> Reduction:
    """A compact ``Reduction`` with its cut worked out from ``pieces`` (either layout).

    The cut follows each piece's start in its segment, so it fits both the planned layout
    (pieces back to back) and the placed one (FSDP2's padded chunks: a gap after a short last
    piece); ``add_compact`` relies on each tensor's pieces being consecutive in the tensor in
    rank order, which both layouts give and which is checked here, once per mask."""
    cut: list[int] = []
    lengths: dict[int, list[int]] = {}
    slots: dict[int, list[int]] = {}
    taken: dict[int, int] = {}
    for rank, rank_pieces in enumerate(pieces):
        used = 0
        for i, start, length, dst in rank_pieces:
            if length and start != taken.get(i, 0):
                raise AssertionError(
                    f"compact reduction: tensor {i}'s piece on rank {rank} starts at {start}, "
                    f"not at {taken.get(i, 0)} (its pieces must be consecutive in rank order)"
                )
            if dst < used:
                raise AssertionError(
                    f"compact reduction: tensor {i}'s piece on rank {rank} overlaps the one "
                    f"before it in the segment ({dst} < {used})"
                )
            if dst > used:
                cut.append(dst - used)
            taken[i] = taken.get(i, 0) + length
            lengths.setdefault(i, []).append(length)
            slots.setdefault(i, []).append(len(cut))
            cut.append(length)
            used = dst + length
        if used > segment:
            raise AssertionError(
                f"compact reduction: rank {rank}'s pieces take {used} > {segment} elements"
            )
        cut.append(segment - used)
    by_tensor = {i: (tuple(lengths[i]), tuple(slots[i])) for i in lengths}
    return Reduction(mask, "compact", segment, pieces, tuple(cut), by_tensor)


def add_compact(
    flat: torch.Tensor, reduction: Reduction, grads: Sequence[torch.Tensor | None]
) -> list[bool]:
    """Add the trainable tensors' gradients (full, flat-able; None: no gradient) into the
    compact buffer ``flat`` (rank-major segments): each tensor's pieces, consecutive in the
    tensor, to their slots; one foreach add for the whole group (no launch per piece or
    tensor). Returns which tensors had a gradient."""
    slots = torch.split(flat, list(reduction.cut))
    dst: list[torch.Tensor] = []
    src: list[torch.Tensor] = []
    used = [False] * len(grads)
    for i, (lengths, where) in reduction.by_tensor.items():
        grad = grads[i]
        if grad is None:
            continue
        used[i] = True
        for piece, slot, length in zip(
            torch.split(grad.reshape(-1), list(lengths)), where, lengths, strict=True
        ):
            if length:
                dst.append(slots[slot])
                src.append(piece)
    if dst:
        torch._foreach_add_(dst, src)
    return used
