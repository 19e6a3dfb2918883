"""Preconditioner blocks: the tiles of a matrix, where each rank's piece of a tile lies, owners.

[Note: tiles of at most max_preconditioner_dim per side]
Shampoo and SOAP precondition a matrix ``W`` (a tensor of 3 or more dims is viewed as
``shape[0] x prod(shape[1:])``) tile by tile: rows are cut into bands of ``max_preconditioner_dim``
rows (the last band shorter), columns likewise, and every ``rows x cols`` tile keeps its own left
and right statistics (``rows x rows`` and ``cols x cols``), as Meta's distributed Shampoo does.
Tiles are numbered band by band, left to right.

A rank holds one flat row-major range ``[s, e)`` of ``W``. Tile element ``q`` (row-major inside
the tile, ``i = q // w``, ``j = q % w``) sits at flat index ``(r0 + i) C + c0 + j``, which
increases with ``q``; so the tile elements a rank holds are one contiguous range of the tile's
own row-major storage, and the ranks' ranges tile it in rank order. That is exactly the geometry
of the owner exchange (``exchange.py``), with tiles as its units. Inside the local shard the piece
is at most three strided parts: a partial first row, whole rows (stride ``C``), a partial last
row.

Owners: a tile that lies whole on one rank is computed there (no traffic); a tile cut by a rank
boundary goes to an owner chosen greedily, largest eigendecomposition cost first, onto the rank
with the least cost so far (the whole tiles' cost counted), so the expensive root computations are
balanced. Owners are a function of the layouts of all parameters, fixed for the optimizer's
life: the owner also keeps the tile's state.

The block policy returns ``band rows x C`` elements when the bands divide the rows, so that an
engine never cuts a band and every tile is whole on one rank; otherwise (e.g. 1000 rows in bands
of 256) no single block size can express the bands and it returns 1: the few tiles that rank
boundaries then cut are exchanged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

__all__ = [
    "Tile",
    "PreconditionerBlockPolicy",
    "matrix_shape",
    "tiles_of",
    "tile_ranges",
    "Piece",
    "piece_of",
    "read_piece",
    "write_piece",
    "root_cost",
    "assign_owners",
]


@attrs.frozen
class Tile:
    """Rows ``[r0, r1)`` x columns ``[c0, c1)`` of a matrix."""

    r0: int
    r1: int
    c0: int
    c1: int

    @property
    def rows(self) -> int:
        return self.r1 - self.r0

    @property
    def cols(self) -> int:
        return self.c1 - self.c0

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int] | None:
    """The matrix a tensor is preconditioned as: ``(shape[0], prod(rest))``; None below 2 dims."""
    if len(shape) < 2:
        return None
    return int(shape[0]), math.prod(int(s) for s in shape[1:])


def _cuts(n: int, max_dim: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + max_dim, n)) for lo in range(0, n, max_dim)]


def tiles_of(shape2: tuple[int, int], max_dim: int) -> tuple[Tile, ...]:
    """Every tile of a ``rows x cols`` matrix, band by band (empty for an empty matrix)."""
    rows, cols = shape2
    return tuple(
        Tile(r0, r1, c0, c1) for r0, r1 in _cuts(rows, max_dim) for c0, c1 in _cuts(cols, max_dim)
    )


def _below(tile: Tile, cols: int, x: int) -> int:
    """Number of the tile's elements whose flat index in the matrix is ``< x``."""
    rel = x - tile.r0 * cols
    if rel <= 0:
        return 0
    i, j = divmod(rel, cols)
    if i >= tile.rows:
        return tile.numel
    return i * tile.cols + min(max(j - tile.c0, 0), tile.cols)


def tile_ranges(
    tile: Tile, cols: int, ranges: Sequence[tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """Each rank's ``[a, b)`` of the tile's row-major storage, from its flat range of the matrix."""
    return tuple((_below(tile, cols, s), _below(tile, cols, e)) for s, e in ranges)


@attrs.frozen
class Piece:
    """Where a rank's piece ``[a, b)`` of a tile lies in its local flat shard.

    ``parts`` are ``(local_offset, rows, width)`` runs: ``rows`` rows of ``width`` elements, one
    matrix row (``stride`` elements) apart; their concatenation is the piece in tile order.
    """

    numel: int
    stride: int
    parts: tuple[tuple[int, int, int], ...]


def piece_of(tile: Tile, cols: int, start: int, a: int, b: int) -> Piece:
    """The parts of tile elements ``[a, b)`` in a shard that starts at flat index ``start``."""
    w = tile.cols
    parts: list[tuple[int, int, int]] = []

    def local(q: int) -> int:
        i, j = divmod(q, w)
        return (tile.r0 + i) * cols + tile.c0 + j - start

    q = a
    if q < b and q % w:  # partial first row
        n = min(b, (q // w + 1) * w) - q
        parts.append((local(q), 1, n))
        q += n
    full = (b - q) // w
    if full:
        parts.append((local(q), full, w))
        q += full * w
    if q < b:  # partial last row
        parts.append((local(q), 1, b - q))
    return Piece(b - a, cols, tuple(parts))


def _view(flat: torch.Tensor, offset: int, rows: int, width: int, stride: int) -> torch.Tensor:
    span = flat[offset : offset + (rows - 1) * stride + width]
    return span.unfold(0, width, stride) if rows > 1 else span.view(1, width)


def read_piece(flat: torch.Tensor, piece: Piece, dtype: torch.dtype) -> torch.Tensor:
    """A fresh contiguous ``dtype`` copy of the piece, in tile order."""
    out = torch.empty(piece.numel, dtype=dtype, device=flat.device)
    pos = 0
    for offset, rows, width in piece.parts:
        n = rows * width
        out[pos : pos + n].view(rows, width).copy_(_view(flat, offset, rows, width, piece.stride))
        pos += n
    return out


def write_piece(flat: torch.Tensor, piece: Piece, values: torch.Tensor) -> None:
    """Copy ``values`` (the piece in tile order) into its places of ``flat``."""
    pos = 0
    for offset, rows, width in piece.parts:
        n = rows * width
        _view(flat, offset, rows, width, piece.stride).copy_(
            values[pos : pos + n].view(rows, width)
        )
        pos += n


def root_cost(tile: Tile) -> int:
    """Eigendecomposition cost of a tile's two factors, ``rows^3 + cols^3`` (flops up to a
    constant: a symmetric eigendecomposition with vectors is ~9 n^3)."""
    return tile.rows**3 + tile.cols**3


def assign_owners(
    costs: Sequence[int],
    shares: Sequence[Sequence[int]],
    world: int,
    load: list[int] | None = None,
) -> tuple[int, ...]:
    """An owner rank per tile: the holder of a whole tile, else balanced by cost.

    ``shares[i][k]`` is how many of tile ``i``'s elements rank ``k`` holds. Whole tiles stay on
    their holder; cut tiles, by decreasing cost (ties: lower index), go to the rank with the least
    summed cost so far, ties to the rank holding most of the tile (less traffic), then the lowest
    rank. ``load`` (updated in place) is the cost each rank already owns, from tiles assigned
    earlier. Deterministic: every rank computes the same owners from the same global layouts.
    """
    load = [0] * world if load is None else load
    owners = [-1] * len(costs)
    cut = []
    for i, share in enumerate(shares):
        total = sum(share)
        holder = next((k for k, n in enumerate(share) if n == total), -1) if total else 0
        if holder >= 0:
            owners[i] = holder
            load[holder] += costs[i]
        else:
            cut.append(i)
    for i in sorted(cut, key=lambda j: (-costs[j], j)):
        best = min(range(world), key=lambda k: (load[k], -shares[i][k], k))
        owners[i] = best
        load[best] += costs[i]
    return tuple(owners)


@attrs.frozen
class PreconditionerBlockPolicy:
    """Block requirement of ``Shampoo`` / ``SOAP``: whole bands of tiles on one rank.

    The engine protocol ``(name, param) -> elements``: a band of ``min(rows, max_dim)`` rows times
    the row length when such bands divide the rows (every tile then lies whole on one rank and
    the optimizer exchanges nothing), else 1 (see the module note). Tensors below 2 dims are
    updated elementwise: 1.
    """

    max_preconditioner_dim: int = 1024

    def __attrs_post_init__(self) -> None:
        if self.max_preconditioner_dim < 1:
            raise ValueError(
                f"max_preconditioner_dim must be >= 1, got {self.max_preconditioner_dim}"
            )

    def __call__(self, name: str, param: torch.Tensor) -> int:
        shape2 = matrix_shape(tuple(param.shape))
        if shape2 is None or shape2[0] * shape2[1] == 0:
            return 1
        rows, cols = shape2
        band = min(rows, self.max_preconditioner_dim)
        return band * cols if rows % band == 0 else 1
