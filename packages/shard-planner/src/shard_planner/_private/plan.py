"""The frozen result of planning: a flat buffer layout cut into equal shards.

[Note: the layout]
The buffer has ``world_size * shard_size`` elements; rank ``k`` owns ``[k*S, (k+1)*S)``. Tensor
``i`` occupies ``[offsets[i], offsets[i] + numels[i])``. A boundary ``k*S`` (``0 < k < m``) that
falls strictly inside tensor ``i`` must satisfy ``(k*S - offsets[i]) % blocks[i] == 0``. Hence each
rank holds a whole number of every tensor's blocks, which is what ``local_units`` reports and what
``RaggedShard((0,), local_units)`` consumes when the block is the unit.

[Note: zero-size tensors]
A zero-size tensor occupies nothing. Its offset is some position in ``[0, m*S)`` (the methods
put it at 0 or where their sequence reached; the value carries no meaning); ``local_units`` is
one-hot on the rank owning that offset (so a RaggedShard gets a non-zero unit sum) and
``rank_slices`` leaves it out (there is no data to view).

[Note: fingerprint]
``fingerprint`` is the SHA-256 of a canonical JSON text of every field, so it is equal across
processes, Python versions and machines for equal plans (unlike ``hash()``, which is salted for
strings). Ranks exchange it before any collective to detect a disagreement instead of hanging.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Sequence

import attrs

__all__ = ["Plan", "Slice", "first_bad_boundary"]

FINGERPRINT_VERSION = 1


@attrs.frozen
class Slice:
    """Part of a tensor inside one rank's shard.

    Elements ``[tensor_start, tensor_stop)`` of tensor ``tensor_index`` (flat, row-major) sit at
    ``[shard_start, shard_stop)`` of the rank's shard; both ranges have the same length.
    """

    tensor_index: int
    tensor_start: int
    tensor_stop: int
    shard_start: int
    shard_stop: int

    @property
    def numel(self) -> int:
        return self.tensor_stop - self.tensor_start


def first_bad_boundary(offset: int, numel: int, block: int, shard_size: int) -> int | None:
    """The first shard boundary cutting a block of the tensor, or ``None`` if none does.

    Boundaries strictly inside ``(offset, offset + numel)`` are ``b, b + S, b + 2S, ...`` with
    ``b`` the first multiple of ``S`` above ``offset``. The first is fine iff ``b - offset`` is a
    multiple of the block; every further one is then fine iff ``S`` is, so two checks suffice.
    """
    stop = offset + numel
    b = (offset // shard_size + 1) * shard_size
    if b >= stop:
        return None
    if (b - offset) % block != 0:
        return b
    if b + shard_size < stop and shard_size % block != 0:
        return b + shard_size
    return None


@attrs.frozen
class Plan:
    """Where each tensor of a group sits in one flat buffer of ``world_size`` equal shards.

    Fields are in input order except ``order``, the placement order (tensor indices by offset).
    Equal plans compare and hash equal; see ``fingerprint`` for a cross-process identity.
    """

    world_size: int
    shard_size: int
    align: int
    numels: tuple[int, ...]
    blocks: tuple[int, ...]
    names: tuple[str, ...]
    offsets: tuple[int, ...]
    order: tuple[int, ...]
    method: str = attrs.field(default="", eq=False)
    # True when the planner proved ``shard_size`` minimal (``search`` [Note: when "auto" is
    # exact]); False means "not proven", not "not optimal". Not part of equality or identity.
    optimal: bool = attrs.field(default=False, eq=False)
    # Every tensor's offset is a multiple of it (``align`` [Note: why offsets, not only shard
    # sizes]); 1 puts no constraint on offsets.
    offset_align: int = 1
    # Non-empty tensors along ``order`` and their offsets; derived, for O(log T) rank lookups.
    _nonempty: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)
    _starts: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        nonempty = tuple(i for i in self.order if self.numels[i] > 0)
        object.__setattr__(self, "_nonempty", nonempty)
        object.__setattr__(self, "_starts", tuple(self.offsets[i] for i in nonempty))

    # -- figures ---------------------------------------------------------------------------
    @property
    def num_tensors(self) -> int:
        return len(self.numels)

    @property
    def total_numel(self) -> int:
        return sum(self.numels)

    @property
    def buffer_numel(self) -> int:
        """``world_size * shard_size``: elements of the gathered (unsharded) buffer."""
        return self.world_size * self.shard_size

    @property
    def padding(self) -> int:
        return self.buffer_numel - self.total_numel

    @property
    def padding_ratio(self) -> float:
        """Padding over payload (``padding / total_numel``); 0.0 for an all-empty group."""
        total = self.total_numel
        return self.padding / total if total else 0.0

    # -- per tensor / per rank ---------------------------------------------------------------
    def _check_index(self, index: int) -> None:
        if not 0 <= index < len(self.numels):
            raise ValueError(
                f"tensor index {index} out of range for a plan of {len(self.numels)} tensors"
            )

    def tensor_range(self, index: int) -> tuple[int, int]:
        """Global ``[start, stop)`` of tensor ``index`` in the buffer."""
        self._check_index(index)
        return self.offsets[index], self.offsets[index] + self.numels[index]

    def local_units(self, index: int) -> tuple[int, ...]:
        """Blocks of tensor ``index`` inside each rank's shard ``[k*S, (k+1)*S)``.

        The units tile the whole tensor (they sum to ``numels[index] // blocks[index]``) and rank
        ``k`` owns one contiguous range of them, as ``RaggedShard(dims, local_units)`` requires.
        """
        self._check_index(index)
        m, s = self.world_size, self.shard_size
        start, numel, block = self.offsets[index], self.numels[index], self.blocks[index]
        if numel == 0:
            owner = min(start // s, m - 1)
            return (0,) * owner + (1,) + (0,) * (m - owner - 1)
        # Ranks first..last hold it: the ends partly, every rank between a whole shard (S is
        # then a multiple of the block). Built from repeated tuples: no Python step per rank.
        stop = start + numel
        first, last = start // s, (stop - 1) // s
        if first == last:
            return (0,) * first + (numel // block,) + (0,) * (m - first - 1)
        return (
            (0,) * first
            + (((first + 1) * s - start) // block,)
            + (s // block,) * (last - first - 1)
            + ((stop - last * s) // block,)
            + (0,) * (m - last - 1)
        )

    def rank_slices(self, rank: int) -> tuple[Slice, ...]:
        """The non-empty tensor parts in rank ``rank``'s shard, in shard order."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world_size {self.world_size}")
        s = self.shard_size
        lo, hi = rank * s, (rank + 1) * s
        # A tensor starting before ``lo`` may still reach into this shard: start one earlier.
        pos = max(bisect.bisect_right(self._starts, lo) - 1, 0)
        found: list[Slice] = []
        for index in self._nonempty[pos:]:
            start = self.offsets[index]
            if start >= hi:
                break
            stop = start + self.numels[index]
            if stop <= lo:
                continue
            a, b = max(start, lo), min(stop, hi)
            found.append(Slice(index, a - start, b - start, a - lo, b - lo))
        return tuple(found)

    # -- identity and checks -------------------------------------------------------------------
    def canonical(self) -> str:
        """Canonical JSON text of the plan (the fingerprint's preimage)."""
        return json.dumps(
            {
                "v": FINGERPRINT_VERSION,
                "world_size": self.world_size,
                "shard_size": self.shard_size,
                "align": self.align,
                "numels": list(self.numels),
                "blocks": list(self.blocks),
                "names": list(self.names),
                "offsets": list(self.offsets),
                "order": list(self.order),
                # only when set, so plans without it keep their fingerprints
                **({"offset_align": self.offset_align} if self.offset_align != 1 else {}),
            },
            sort_keys=True,
            separators=(",", ":"),
            ensure_ascii=True,
        )

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of :meth:`canonical`; equal plans give equal fingerprints."""
        return hashlib.sha256(self.canonical().encode("ascii")).hexdigest()

    def validate(self) -> None:
        """Re-check every invariant; raise ``ValueError`` naming the first violation."""
        validate_layout(
            self.numels,
            self.blocks,
            self.offsets,
            self.order,
            world_size=self.world_size,
            shard_size=self.shard_size,
            align=self.align,
            names=self.names,
            offset_align=self.offset_align,
        )


def _name(names: Sequence[str], index: int) -> str:
    name = names[index] if index < len(names) else ""
    return f"tensor {index} ({name!r})" if name else f"tensor {index}"


def validate_layout(
    numels: Sequence[int],
    blocks: Sequence[int],
    offsets: Sequence[int],
    order: Sequence[int],
    *,
    world_size: int,
    shard_size: int,
    align: int,
    names: Sequence[str] = (),
    offset_align: int = 1,
) -> None:
    """Check a layout: sizes, alignment, containment, disjointness, contiguity, no cut block."""
    n = len(numels)
    if not (len(blocks) == len(offsets) == n and len(order) == n):
        raise ValueError(
            f"plan fields disagree in length: numels {n}, blocks {len(blocks)}, "
            f"offsets {len(offsets)}, order {len(order)}"
        )
    if names and len(names) != n:
        raise ValueError(f"plan has {len(names)} names for {n} tensors")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if align < 1 or shard_size < 1 or shard_size % align != 0:
        raise ValueError(f"shard_size {shard_size} must be a positive multiple of align {align}")
    if offset_align < 1 or align % offset_align != 0:
        raise ValueError(f"offset_align {offset_align} must be >= 1 and divide align {align}")
    if sorted(order) != list(range(n)):
        raise ValueError(f"order {tuple(order)} is not a permutation of range({n})")
    capacity = world_size * shard_size
    previous_stop, previous = 0, -1
    last_start = -1
    for index in order:
        start, numel, block = offsets[index], numels[index], blocks[index]
        who = _name(names, index)
        if block < 1 or numel < 0 or numel % block != 0:
            raise ValueError(f"{who}: block {block} must be >= 1 and divide numel {numel}")
        if start < last_start:
            raise ValueError(f"{who}: offsets are not non-decreasing along order")
        last_start = start
        if start % offset_align != 0:
            raise ValueError(f"{who}: offset {start} is not a multiple of {offset_align}")
        if numel == 0:
            if not 0 <= start < capacity:
                raise ValueError(f"{who}: offset {start} outside [0, {capacity})")
            continue
        if start < 0 or start + numel > capacity:
            raise ValueError(
                f"{who}: range [{start}, {start + numel}) outside the buffer "
                f"[0, {capacity}) of {world_size} x {shard_size}"
            )
        if start < previous_stop:
            raise ValueError(
                f"{who}: range [{start}, {start + numel}) overlaps "
                f"{_name(names, previous)} ending at {previous_stop}"
            )
        bad = first_bad_boundary(start, numel, block, shard_size)
        if bad is not None:
            raise ValueError(
                f"{who}: shard boundary {bad} cuts a block of {block} elements "
                f"(tensor at [{start}, {start + numel}))"
            )
        previous_stop, previous = start + numel, index
