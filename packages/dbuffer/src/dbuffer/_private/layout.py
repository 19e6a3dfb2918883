"""The layout a DBuffer needs, and the per-tensor geometry derived from it.

[Note: who owns the layout type]
dbuffer never imports the planner. It states what it needs as a ``typing.Protocol``
(``BufferLayout``); the planner's frozen ``Plan`` satisfies it structurally, and so does the naive
``contiguous_layout`` below (for tests, examples and small groups). Members are read-only
properties so that frozen attrs/dataclass attributes satisfy them under mypy.

[Note: the geometry of one tensor in the flat buffer]
The flat buffer has ``m * S`` elements (m ranks, S elements per shard). Tensor i occupies
``[off_i, off_i + n_i)``; rank k's shard is ``[k*S, (k+1)*S)``. Their intersection is a contiguous
range of the tensor's row-major storage, so rank k's share of tensor i is the 1-D slice
``shard[max(off_i, k*S) - k*S : min(off_i + n_i, (k+1)*S) - k*S]`` -- a view, never a copy. The
layout promises that no block is cut by a shard boundary, so each share is a whole number of
blocks, ``local_units(i)[k]``, and one RaggedShard unit is ``n_i / sum(local_units(i))`` elements.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import operator
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from ragged_dtensor import RaggedShard

__all__ = [
    "BufferLayout",
    "ContiguousLayout",
    "TensorSlot",
    "contiguous_layout",
    "slots_for",
]


@runtime_checkable
class BufferLayout(Protocol):
    """What a DBuffer needs to know about where each tensor lives in the flat buffer.

    All sizes are in elements. The flat buffer has ``world_size * shard_size`` elements; tensor i
    occupies ``[offsets[i], offsets[i] + numels[i])``; ``local_units(i)[k]`` is the number of tensor
    i's blocks inside rank k's shard ``[k * shard_size, (k + 1) * shard_size)``. ``fingerprint`` is
    a stable string that is equal on two ranks exactly when their layouts are equal.
    """

    @property
    def shard_size(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def offsets(self) -> tuple[int, ...]: ...

    @property
    def numels(self) -> tuple[int, ...]: ...

    @property
    def fingerprint(self) -> str: ...

    def local_units(self, i: int) -> tuple[int, ...]: ...


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@attrs.frozen
class ContiguousLayout:
    """A naive layout: tensors concatenated in input order, padded so that no block is cut.

    Satisfies ``BufferLayout``. Build it with ``contiguous_layout``.
    """

    shard_size: int
    world_size: int
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    blocks: tuple[int, ...]

    @property
    def fingerprint(self) -> str:
        text = repr((self.shard_size, self.world_size, self.offsets, self.numels, self.blocks))
        return "contiguous:" + hashlib.sha256(text.encode()).hexdigest()[:32]

    def local_units(self, i: int) -> tuple[int, ...]:
        start, numel = self.offsets[i], self.numels[i]
        if numel == 0:  # one (empty) unit on the rank where it starts, as the planner does
            return _empty_units(start, self.shard_size, self.world_size)
        return span_units(start, numel, self.blocks[i], self.shard_size, self.world_size)


def _empty_units(offset: int, size: int, world: int) -> tuple[int, ...]:
    owner = min(offset // size, world - 1)
    return (0,) * owner + (1,) + (0,) * (world - owner - 1)


def span_units(start: int, numel: int, block: int, size: int, world: int) -> tuple[int, ...]:
    """Blocks of a tensor at ``[start, start + numel)`` in each of ``world`` shards of ``size``.

    The tensor touches ranks ``first = start // S`` to ``last = (start + numel - 1) // S``: the
    first holds ``min(stop, (first + 1) S) - start`` elements, the last ``stop - last S``, every
    rank between a whole shard of ``S`` elements (``S / block`` blocks: both of its boundaries
    fall on block boundaries, so the block divides ``S``), the rest nothing. Built from
    repeated tuples, so the cost does not grow with ``world`` in Python steps.
    """
    stop = start + numel
    first, last = start // size, (stop - 1) // size
    if first == last:
        return (0,) * first + (numel // block,) + (0,) * (world - first - 1)
    head = ((first + 1) * size - start) // block
    tail = (stop - last * size) // block
    return (
        (0,) * first
        + (head,)
        + (size // block,) * (last - first - 1)
        + (tail,)
        + (0,) * (world - last - 1)
    )


def first_cut(start: int, numel: int, block: int, size: int) -> int | None:
    """The first shard boundary strictly inside ``[start, start + numel)`` that cuts a block.

    Boundaries inside are ``b, b + S, b + 2S, ...`` with ``b`` the first multiple of ``S`` after
    ``start``. ``b`` cuts iff ``(b - start) % block != 0``; if it does not, every later one cuts
    iff ``S % block != 0`` (then ``b + S`` is the first), so two checks decide.
    """
    stop = start + numel
    b = (start // size + 1) * size
    if b >= stop:
        return None
    if (b - start) % block:
        return b
    if b + size < stop and size % block:
        return b + size
    return None


def _place(
    numels: Sequence[int], blocks: Sequence[int], size: int, world: int, align: int
) -> tuple[int, ...] | None:
    """Greedy placement for a fixed shard size: each tensor at the first aligned start after the
    previous one such that every shard boundary strictly inside it falls on one of its blocks.

    A tensor that would have a block cut is moved to start at the offending boundary (a start on
    a boundary never cuts that boundary). Returns None when the tensors do not fit in ``world``
    shards of ``size``.
    """
    offsets = []
    cursor = 0
    total = size * world
    for numel, block in zip(numels, blocks, strict=True):
        start = _round_up(cursor, align)
        # A start on the offending boundary never cuts it (and is aligned: S is a multiple of
        # align); at most one move per boundary crossed, usually none.
        while start + numel <= total and (cut := first_cut(start, numel, block, size)) is not None:
            start = cut
        if start + numel > total:
            return None
        offsets.append(start)
        cursor = start + numel
    return tuple(offsets)


def contiguous_layout(
    numels: Sequence[int], world_size: int, *, blocks: Sequence[int] | None = None, align: int = 1
) -> ContiguousLayout:
    """Concatenate tensors of ``numels`` elements in order into ``world_size`` equal shards.

    ``blocks[i]`` (default 1: element granular) must divide ``numels[i]``; no block is ever cut by
    a shard boundary. Every tensor starts at a multiple of ``align`` and the shard size is a
    multiple of ``align`` (use it for 16-byte collective alignment). The shard size starts at the
    smallest candidate ``ceil(sum(numels) / world_size)`` and grows until the greedy placement
    fits; this is a simple reference layout, not the planner (which minimises padding).
    """
    numels = tuple(int(n) for n in numels)
    blocks = tuple(int(b) for b in blocks) if blocks is not None else (1,) * len(numels)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if len(blocks) != len(numels):
        raise ValueError(f"blocks has {len(blocks)} entries for {len(numels)} tensors")
    for i, (numel, block) in enumerate(zip(numels, blocks, strict=True)):
        if numel < 0:
            raise ValueError(f"tensor {i}: numel must be >= 0, got {numel}")
        if block <= 0 or numel % block:
            raise ValueError(f"tensor {i}: block {block} must be > 0 and divide numel {numel}")
    size = _round_up(max(1, -(-sum(numels) // world_size)), align)
    while True:
        offsets = _place(numels, blocks, size, world_size, align)
        if offsets is not None:
            return ContiguousLayout(size, world_size, offsets, numels, blocks)
        # Grow by ~1/256 per try: a few hundred tries at most, within ~0.4% of the first fit.
        size += _round_up(max(1, size // 256), align)


@attrs.frozen
class TensorSlot:
    """Where one tensor lives: its flat range, its shape, and this rank's share."""

    index: int
    name: str
    shape: tuple[int, ...]
    offset: int  # global offset in the flat buffer of world_size * shard_size elements
    numel: int
    placement: RaggedShard
    local_start: int  # this rank's share, as offsets into its own shard storage
    local_stop: int
    tensor_start: int  # where this rank's share starts inside the tensor's flat storage

    @property
    def local_numel(self) -> int:
        return self.local_stop - self.local_start

    @property
    def stride(self) -> tuple[int, ...]:
        """Row-major strides as torch computes them (a size-0 dim counts as 1)."""
        return tuple(
            math.prod(max(1, s) for s in self.shape[d + 1 :]) for d in range(len(self.shape))
        )


def _choose_dims(shape: tuple[int, ...], total_units: int) -> tuple[int, ...]:
    """The shortest non-empty prefix of dims whose row count is cut evenly into the units.

    Any valid prefix gives the same flat ranges; the shortest gives the coarsest (most readable)
    unit, e.g. ``(0,)`` when a block is a whole number of rows. All dims always work because the
    unit is a whole number of elements.
    """
    if not shape:
        return ()
    for d in range(1, len(shape) + 1):
        if math.prod(shape[:d]) % total_units == 0:
            return tuple(range(d))
    raise AssertionError("unreachable: the product of all dims is numel")  # pragma: no cover


def _inside(k: int, offset: int, numel: int, size: int) -> int:
    """Elements of ``[offset, offset + numel)`` inside rank ``k``'s shard."""
    return max(0, min(offset + numel, (k + 1) * size) - max(offset, k * size))


def _units_match(units: tuple[int, ...], unit: int, offset: int, numel: int, size: int) -> bool:
    """Whether ``units[k] * unit`` is what rank k's shard holds of the tensor, for every k.

    Only the ranks the tensor touches (``first`` to ``last``) hold anything: the two ends are
    checked one by one, the ranks between must all hold a whole shard and the rest nothing,
    which slice counts decide without a Python step per rank.
    """
    first, last = offset // size, (offset + numel - 1) // size
    if any(units[:first]) or any(units[last + 1 :]):
        return False
    if units[first] * unit != _inside(first, offset, numel, size):
        return False
    if last == first:
        return True
    if units[last] * unit != _inside(last, offset, numel, size):
        return False
    middle = last - first - 1
    if not middle:
        return True
    return size % unit == 0 and units[first + 1 : last].count(size // unit) == middle


def _first_mismatch(
    units: tuple[int, ...], unit: int, offset: int, numel: int, size: int
) -> tuple[int, int]:
    """The first rank whose units disagree with the layout (error path only)."""
    for k, u in enumerate(units):
        inside = _inside(k, offset, numel, size)
        if inside != u * unit:
            return k, inside
    raise AssertionError("unreachable: _units_match found a mismatch")  # pragma: no cover


def _short(units: tuple[int, ...]) -> str:
    """``units`` for an error message; long tuples (thousands of ranks) elided."""
    if len(units) <= 16:
        return repr(units)
    head, tail = ", ".join(map(str, units[:8])), ", ".join(map(str, units[-4:]))
    return f"({head}, ..., {tail}) ({len(units)} ranks)"


@functools.lru_cache(maxsize=1024)
def _placement(dims: tuple[int, ...], units: tuple[int, ...]) -> RaggedShard:
    """One ``RaggedShard`` per distinct (dims, units): identical layers share it (building one
    checks every rank's units; placements are immutable)."""
    return RaggedShard(dims, units)


def slots_for(
    layout: BufferLayout, shapes: Sequence[Sequence[int]], names: Sequence[str], rank: int
) -> tuple[TensorSlot, ...]:
    """Check ``layout`` against ``shapes`` and derive every tensor's slot for ``rank``.

    Raises ``ValueError`` naming the tensor whose shape, offset or units disagree with the layout.
    """
    size, world = int(layout.shard_size), int(layout.world_size)
    offsets, numels = tuple(layout.offsets), tuple(layout.numels)
    if size <= 0:
        raise ValueError(f"layout shard_size must be > 0, got {size}")
    if not len(shapes) == len(offsets) == len(numels) == len(names):
        raise ValueError(
            f"layout describes {len(offsets)} offsets and {len(numels)} numels for "
            f"{len(shapes)} shapes and {len(names)} names"
        )
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside the layout's world_size {world}")
    slots = []
    spans = []
    for i, (shape_seq, offset, numel, name) in enumerate(
        zip(shapes, offsets, numels, names, strict=True)
    ):
        shape = tuple(int(s) for s in shape_seq)
        where = f"tensor {name!r} (index {i})"
        if math.prod(shape) != numel:
            raise ValueError(
                f"{where}: shape {shape} has {math.prod(shape)} elements but the "
                f"layout gives it {numel}"
            )
        if offset < 0 or offset + numel > size * world:
            raise ValueError(
                f"{where}: range [{offset}, {offset + numel}) lies outside the flat "
                f"buffer of {world} x {size} elements"
            )
        units = tuple(map(operator.index, layout.local_units(i)))
        if numel == 0:
            # Nothing to hold: one empty unit (dims=()) on one rank; any layout's units will do.
            units = _empty_units(offset, size, world)
        if len(units) != world:
            raise ValueError(
                f"{where}: local_units {_short(units)} has {len(units)} entries for world_size "
                f"{world}"
            )
        total = sum(units)
        if total <= 0 or numel % total:
            raise ValueError(
                f"{where}: local_units {_short(units)} must sum to a positive divisor of its "
                f"numel {numel}"
            )
        unit = numel // total
        if numel and not _units_match(units, unit, offset, numel, size):
            k, inside = _first_mismatch(units, unit, offset, numel, size)
            raise ValueError(
                f"{where}: rank {k} holds {inside} of its elements in "
                f"[{offset}, {offset + numel}) but local_units {_short(units)} give "
                f"{units[k] * unit} (unit {unit})"
            )
        lo = min(max(offset, rank * size), (rank + 1) * size)
        hi = max(lo, min(offset + numel, (rank + 1) * size))
        placement = _placement(_choose_dims(shape, total), units)
        slots.append(
            TensorSlot(
                i,
                name,
                shape,
                offset,
                numel,
                placement,
                lo - rank * size,
                hi - rank * size,
                placement.flat_range(shape, rank).start,
            )
        )
        spans.append((offset, offset + numel, name))
    spans.sort()
    for (_, stop_a, name_a), (start_b, _, name_b) in itertools.pairwise(spans):
        if start_b < stop_a:
            raise ValueError(f"layout overlaps tensors {name_a!r} and {name_b!r}")
    return tuple(slots)
