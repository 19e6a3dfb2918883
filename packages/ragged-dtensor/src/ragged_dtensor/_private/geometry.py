"""Pure geometry of a ragged split: which flat range and which logical box each rank owns.

Nothing here touches a process group, so every function is usable (and tested) without one.

[Note: the tensor a RaggedShard cuts]
RaggedShard is applied innermost: the tensor it cuts ("X") is what remains after every other
placement of the mesh has been applied. Its ``dims`` are a prefix of X's dimensions; the product of
their sizes P is the number of "prefix rows". Units are P / sum(local_units) prefix rows each, so a
rank's share is always a contiguous range of X's row-major storage, and a *box* (rows x full rest)
whenever ``dims`` is non-empty and each unit spans whole rows of dim 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

__all__ = [
    "FlatRange",
    "flat_range_to_boxes",
    "prefix_rows",
    "rank_flat_range",
    "unit_numel",
    "validate_units",
]


@attrs.frozen
class FlatRange:
    """A half-open range ``[start, stop)`` of a tensor's row-major storage."""

    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def prefix_rows(shape: Sequence[int], dims: Sequence[int]) -> int:
    """P: the product of the sizes of the prefix ``dims`` (1 for ``dims == ()``)."""
    return math.prod(shape[d] for d in dims)


def validate_units(
    shape: Sequence[int], dims: Sequence[int], local_units: Sequence[int], *, where: str = ""
) -> None:
    """Raise ``ValueError`` naming the problem if ``(dims, local_units)`` cannot cut ``shape``."""
    prefix = f"{where}: " if where else ""
    if tuple(dims) != tuple(range(len(dims))):
        raise ValueError(
            f"{prefix}RaggedShard dims {tuple(dims)} must be a prefix (0, 1, ...) of "
            f"the tensor's dimensions"
        )
    if len(dims) > len(shape):
        raise ValueError(
            f"{prefix}RaggedShard dims {tuple(dims)} exceed the tensor's "
            f"{len(shape)} dimensions (shape {tuple(shape)})"
        )
    if any(u < 0 for u in local_units):
        raise ValueError(f"{prefix}RaggedShard local_units {tuple(local_units)} must be >= 0")
    total = sum(local_units)
    if total == 0:
        raise ValueError(f"{prefix}RaggedShard local_units {tuple(local_units)} sum to 0")
    rows = prefix_rows(shape, dims)
    if not dims and sum(1 for u in local_units if u) != 1:
        raise ValueError(
            f"{prefix}RaggedShard(dims=()) treats the whole tensor as one unit: "
            f"local_units {tuple(local_units)} must be one-hot"
        )
    if rows % total != 0:
        raise ValueError(
            f"{prefix}RaggedShard local_units {tuple(local_units)} sum to {total}, "
            f"which does not divide the {rows} prefix rows of dims {tuple(dims)} "
            f"of shape {tuple(shape)}"
        )


def unit_numel(shape: Sequence[int], local_units: Sequence[int]) -> int:
    """Elements per unit: ``numel / sum(local_units)``."""
    return math.prod(shape) // sum(local_units)


def rank_flat_range(shape: Sequence[int], local_units: Sequence[int], rank: int) -> FlatRange:
    """The flat range of X's storage that ``rank`` (its coordinate on the axis) owns."""
    unit = unit_numel(shape, local_units)
    start = sum(local_units[:rank]) * unit
    return FlatRange(start, start + local_units[rank] * unit)


def flat_range_to_boxes(
    shape: Sequence[int], flat: FlatRange
) -> list[tuple[tuple[int, ...], tuple[int, ...], FlatRange]]:
    """Cut a flat row-major range into the fewest contiguous boxes.

    Returns ``(offset, size, flat_subrange)`` triples in storage order; each box is contiguous in
    row-major order, so ``local_flat[sub.start - flat.start : sub.stop - flat.start].view(size)`` is
    exactly that box. At most ``2 * ndim - 1`` boxes: partial pieces climbing up the dimensions,
    one run of whole slabs, partial pieces climbing down.
    """
    ndim = len(shape)
    if flat.numel == 0:
        return []
    if ndim == 0:
        return [((), (), flat)]
    # strides[d] = elements in one step of dim d
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...], FlatRange]] = []
    pos, stop = flat.start, flat.stop
    while pos < stop:
        # The largest dimension d such that pos is aligned to strides[d] and at least one full
        # step of d fits; take as many steps of that dimension as fit without crossing dim d-1.
        for d in range(ndim):
            step = strides[d]
            if pos % step == 0 and pos + step <= stop:
                outer = strides[d - 1] if d > 0 else step * shape[0]
                next_outer = (pos // outer + 1) * outer
                count = min((stop - pos) // step, (next_outer - pos) // step)
                offset = _unravel(pos, shape, strides)
                size = tuple([1] * d + [count] + list(shape[d + 1 :]))
                boxes.append((offset, size, FlatRange(pos, pos + count * step)))
                pos += count * step
                break
        else:  # pragma: no cover - strides[-1] == 1 always fits
            raise AssertionError("unreachable")
    return boxes


def _unravel(pos: int, shape: Sequence[int], strides: Sequence[int]) -> tuple[int, ...]:
    return tuple((pos // strides[d]) % shape[d] for d in range(len(shape)))
