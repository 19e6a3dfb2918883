"""The ``RaggedShard`` placement."""

from __future__ import annotations

import operator
import sys
from collections.abc import Sequence

import attrs
import torch
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private import geometry

__all__ = ["RaggedShard"]


def _integration_installed() -> bool:
    compat = sys.modules.get("ragged_dtensor._private.compat")
    return compat is not None and bool(compat.dtensor_integration_installed())


def _as_int_tuple(value: Sequence[int]) -> tuple[int, ...]:
    try:
        return tuple(operator.index(v) for v in value)
    except TypeError:
        raise TypeError(
            f"RaggedShard dims and local_units must be integers, got {tuple(value)!r}"
        ) from None


@attrs.frozen(weakref_slot=False, eq=False, repr=False)
class RaggedShard(Placement):
    """Contiguous blocks of any size, a different number of blocks per rank.

    ``dims`` is a prefix of the tensor's dimensions whose product P (the "prefix rows") is cut into
    ``sum(local_units)`` equal units; rank ``k`` of the mesh axis owns the next ``local_units[k]``
    units, i.e. one contiguous flat range of the tensor's row-major storage. The local tensor of a
    ragged DTensor is that flat 1-D slice. ``dims=()`` makes the whole tensor one unit held by one
    rank (``local_units`` one-hot), e.g. a Muon root.

    Example: a (32, 128) tensor with ``RaggedShard((0,), (0, 1, 5, 2))`` on 4 ranks: a unit is 4
    rows; rank 0 holds nothing, rank 1 rows 0-3, rank 2 rows 4-23, rank 3 rows 24-31.
    """

    dims: tuple[int, ...] = attrs.field(converter=_as_int_tuple)
    local_units: tuple[int, ...] = attrs.field(converter=_as_int_tuple)

    def __attrs_pre_init__(self) -> None:
        # Placement is a pybind11 class in torch 2.13: skipping its __init__ builds an object that
        # segfaults on the first C++ method call (is_shard()).
        super().__init__()

    def __attrs_post_init__(self) -> None:
        if self.dims != tuple(range(len(self.dims))):
            raise ValueError(
                f"RaggedShard dims {self.dims} must be a prefix (0, 1, ...) of the "
                f"tensor's dimensions"
            )
        if not self.local_units:
            raise ValueError(
                "RaggedShard local_units must have one entry per rank of the mesh axis"
            )
        if any(u < 0 for u in self.local_units):
            raise ValueError(f"RaggedShard local_units {self.local_units} must all be >= 0")
        if sum(self.local_units) == 0:
            raise ValueError(f"RaggedShard local_units {self.local_units} sum to 0")
        if not self.dims and sum(1 for u in self.local_units if u) != 1:
            raise ValueError(
                f"RaggedShard(dims=()) makes the whole tensor one unit: local_units "
                f"{self.local_units} must be one-hot"
            )
        if not _integration_installed():
            # the first RaggedShard of the process (or the first since the integration was
            # removed) installs torch's DTensor integration: see compat.py
            from ragged_dtensor._private import compat

            compat.ensure_installed()

    def __reduce__(self) -> tuple[object, ...]:
        # Unpickling calls the constructor: the placement is checked, torch's Placement base is
        # initialised, and the receiving process gets the DTensor integration.
        return (type(self), (self.dims, self.local_units))

    # -- torch Placement protocol -------------------------------------------------------------
    def is_shard(self, dim: int | None = None) -> bool:
        # Not a Shard(dim): torch's Shard code paths must never treat it as one.
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RaggedShard) or type(other) is not type(self):
            return False
        return self.dims == other.dims and self.local_units == other.local_units

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dims, self.local_units))

    def __repr__(self) -> str:
        return f"RaggedShard(dims={self.dims}, local_units={self.local_units})"

    def __str__(self) -> str:
        return f"RS({self.dims}, {self.local_units})"

    def __fx_repr__(self) -> tuple[str, dict[str, object]]:
        return f"RaggedShard({self.dims!r}, {self.local_units!r})", {"RaggedShard": RaggedShard}

    # -- geometry ---------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return len(self.local_units)

    @property
    def total_units(self) -> int:
        return sum(self.local_units)

    def validate(self, shape: Sequence[int], *, where: str = "") -> None:
        """Raise ``ValueError`` if this placement cannot cut a tensor of ``shape``."""
        geometry.validate_units(shape, self.dims, self.local_units, where=where)

    def unit_numel(self, shape: Sequence[int]) -> int:
        """Elements per unit for a tensor of ``shape``."""
        return geometry.unit_numel(shape, self.local_units)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.local_units):
            raise ValueError(
                f"{self!r}: mesh-axis coordinate {rank} is outside the axis of "
                f"{len(self.local_units)} ranks"
            )

    def flat_range(self, shape: Sequence[int], rank: int) -> geometry.FlatRange:
        """The flat range of the tensor's row-major storage held by axis coordinate ``rank``."""
        self._check_rank(rank)
        return geometry.rank_flat_range(shape, self.local_units, rank)

    def local_numel(self, shape: Sequence[int], rank: int) -> int:
        self._check_rank(rank)
        return self.local_units[rank] * self.unit_numel(shape)

    def max_local_numel(self, shape: Sequence[int]) -> int:
        return max(self.local_units) * self.unit_numel(shape)

    def is_box(self, shape: Sequence[int]) -> bool:
        """True when every rank's share is a box (whole slices of dim 0)."""
        return (
            bool(self.dims)
            and len(shape) > 0
            and self.unit_numel(shape) % max(1, torch.Size(shape)[1:].numel()) == 0
        )

    def local_box(self, shape: Sequence[int], rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(local_shape, global_offset)`` of ``rank``'s share as a box of the tensor.

        Defined when ``is_box(shape)``: the share is ``rows x shape[1:]``. Raises otherwise.
        """
        if not self.is_box(shape):
            raise ValueError(
                f"{self!r} on shape {tuple(shape)}: a rank's share is a flat range "
                f"that is not a box (units are not whole dim-0 slices)"
            )
        row = torch.Size(shape)[1:].numel()
        flat = self.flat_range(shape, rank)
        return ((flat.numel // row, *shape[1:]), (flat.start // row, *([0] * (len(shape) - 1))))


@attrs.frozen(weakref_slot=False, eq=False, repr=False)
class RaggedBoxView(RaggedShard):
    """Internal: the same layout as ``RaggedShard`` with the local tensor viewed as its box.

    Only op dispatch uses it, as the "redistribution" target of an operand whose op needs the
    share's shape (row-wise reductions): going there is a local ``view``, never communication.
    """

    def __repr__(self) -> str:
        return f"RaggedBoxView(dims={self.dims}, local_units={self.local_units})"


@attrs.frozen(weakref_slot=False, eq=False, repr=False)
class _FilledView(RaggedShard):
    """Internal: ``RaggedShard``'s layout with a ``fill`` value that is part of its identity
    (equality, hash, pickling, repr) for the op-dispatch views below."""

    fill: float = attrs.field(default=0.0, kw_only=True)

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and isinstance(other, _FilledView)
            and self.dims == other.dims
            and self.local_units == other.local_units
            and self.fill == other.fill
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dims, self.local_units, self.fill))

    def __reduce__(self) -> tuple[object, ...]:
        return (_filled_view, (type(self), self.dims, self.local_units, self.fill))

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(dims={self.dims}, local_units={self.local_units}, "
            f"fill={self.fill})"
        )


def _filled_view(
    cls: type[_FilledView], dims: Sequence[int], local_units: Sequence[int], fill: float
) -> _FilledView:
    return cls(dims, local_units, fill=fill)


@attrs.frozen(weakref_slot=False, eq=False, repr=False)
class RaggedPaddedView(_FilledView):
    """Internal: the same layout as ``RaggedShard`` with the local share written into a tensor of
    X's full shape, every other element ``fill`` (the identity of the reduction that follows).

    Only op dispatch uses it, for reductions over some dims of a share that is not a box: each
    rank reduces its padded tensor to a full-size partial result (a local copy, no
    communication).
    """


@attrs.frozen(weakref_slot=False, eq=False, repr=False)
class RaggedNonEmptyView(_FilledView):
    """Internal: the same layout as ``RaggedShard`` with an empty local share replaced by one
    element ``fill`` (the identity of the whole-tensor reduction that follows); a non-empty
    share is passed as it is (no copy).

    Only op dispatch uses it, for whole-tensor reductions without an identity on an empty
    tensor (the inf / -inf norms: a rank holding no element of a parameter is common in a
    planned layout). Each rank's result is its partial value; ``fill`` never changes the
    combined result (0 for the inf norm, whose partial values are >= 0; +inf for -inf).
    """


@attrs.frozen(weakref_slot=False, eq=False, repr=False)
class RaggedBroadcastView(RaggedShard):
    """Internal: a Replicate operand broadcast to ``shape`` and cut like ``RaggedShard`` on
    ``shape`` (the share of the broadcast tensor this rank needs, a local copy of about the
    share's size; no communication).

    Only op dispatch uses it, as the "redistribution" target of a Replicate operand of an
    elementwise op that broadcasts it against a ragged operand (a bias, a 1x1 scalar).
    """

    shape: tuple[int, ...] = attrs.field(default=(), kw_only=True, converter=_as_int_tuple)

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and isinstance(other, RaggedBroadcastView)
            and self.dims == other.dims
            and self.local_units == other.local_units
            and self.shape == other.shape
        )

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.dims, self.local_units, self.shape))

    def __reduce__(self) -> tuple[object, ...]:
        return (_broadcast_view, (self.dims, self.local_units, self.shape))

    def __repr__(self) -> str:
        return (
            f"RaggedBroadcastView(dims={self.dims}, local_units={self.local_units}, "
            f"shape={self.shape})"
        )


def _broadcast_view(
    dims: Sequence[int], local_units: Sequence[int], shape: Sequence[int]
) -> RaggedBroadcastView:
    return RaggedBroadcastView(dims, local_units, shape=tuple(shape))
