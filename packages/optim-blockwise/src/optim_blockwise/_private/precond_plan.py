"""Shampoo/SOAP's plan: every preconditioned parameter's tiles and their owners (made once per
parameter), and the owner exchanges of the tiles that rank boundaries cut (made once per layout).
See ``preconditioner``'s notes."""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from optim_blockwise._private import exchange
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.tiles import (
    Piece,
    Tile,
    assign_owners,
    piece_of,
    root_cost,
    tile_ranges,
    tiles_of,
)

__all__ = [
    "BlockItem",
    "Blocks",
    "StateSpec",
    "as_dtype",
    "block_key",
    "dtype_name",
    "check_local_grad",
    "check_max_dim",
    "make_blocks",
    "plan_exchanges",
    "preconditioned",
]

StateSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def dtype_name(dtype: torch.dtype | str, what: str) -> str:
    """A floating dtype kept by name in param groups (full state dicts refuse ``torch.dtype``)."""
    name = str(dtype).removeprefix("torch.")
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype) or found not in (torch.float32, torch.float64):
        raise ValueError(f"{what} must be torch.float32 or torch.float64, got {dtype!r}")
    return name


def as_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name)
    assert isinstance(dtype, torch.dtype)
    return dtype


def block_key(tile: int, name: str) -> str:
    return f"block{tile}_{name}"


@attrs.frozen(eq=False)
class Blocks:
    """A preconditioned parameter's tiles, their per-rank ranges, owners and this rank's pieces."""

    max_dim: int
    cols: int
    tiles: tuple[Tile, ...]
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    owners: tuple[int, ...]
    pieces: tuple[Piece, ...]

    def whole_on(self, t: int, rank: int) -> bool:
        return self.ranges[t][rank] == (0, self.tiles[t].numel)

    def is_cut(self, t: int) -> bool:
        return not any(b - a == self.tiles[t].numel for a, b in self.ranges[t])


@attrs.frozen(eq=False)
class BlockItem:
    param: torch.Tensor
    name: str
    group: dict[str, Any]
    layout: ParamLayout
    blocks: Blocks | None
    """None: updated elementwise (below 2 dims, or ``use_preconditioner=False``)."""


def make_blocks(
    new: dict[
        dist.ProcessGroup | None, list[tuple[torch.Tensor, ParamLayout, tuple[int, int], int]]
    ],
    loads: dict[object, list[int]],
) -> dict[torch.Tensor, Blocks]:
    """Tiles, ranges, owners and this rank's pieces of new preconditioned parameters, per
    process group, assigned on top of the load ``loads`` already holds (updated)."""
    out: dict[torch.Tensor, Blocks] = {}
    for key, entries in new.items():
        world = entries[0][1].world if key is not None else 1
        flat: list[tuple[int, int, Tile]] = []  # (entry, tile index, tile)
        ranges: list[tuple[tuple[int, int], ...]] = []
        per_entry = []
        for e, (_param, layout, shape2, max_dim) in enumerate(entries):
            if layout.world != world:
                raise ValueError(
                    f"parameters sharded over one process group disagree on its size "
                    f"({layout.world} vs {world} ranks, {layout.placement})"
                )
            tiles = tiles_of(shape2, max_dim)
            per_entry.append(tiles)
            rank_ranges = layout.ranges if key is not None else ((0, layout.numel),)
            for t, tile in enumerate(tiles):
                flat.append((e, t, tile))
                ranges.append(tile_ranges(tile, shape2[1], rank_ranges))
        load = loads.setdefault(key, [0] * world)
        owners = assign_owners(
            [root_cost(tile) for _, _, tile in flat],
            [[b - a for a, b in r] for r in ranges],
            world,
            load,
        )
        pos = 0
        for e, (param, layout, shape2, max_dim) in enumerate(entries):
            tiles = per_entry[e]
            n = len(tiles)
            coord = layout.coord if key is not None else 0
            start = layout.start if key is not None else 0
            rr = tuple(ranges[pos : pos + n])
            pieces = tuple(
                piece_of(tile, shape2[1], start, *rr[t][coord]) for t, tile in enumerate(tiles)
            )
            out[param] = Blocks(max_dim, shape2[1], tiles, rr, owners[pos : pos + n], pieces)
            pos += n

    return out


def plan_exchanges(
    by_pg: dict[dist.ProcessGroup, list[tuple[BlockItem, int]]],
    *,
    bucket_cap_mb: float,
    check: bool,
    what: str,
) -> list[tuple[tuple[tuple[BlockItem, int], ...], exchange.OwnerExchange]]:
    """One owner exchange per process group over its cut tiles (``BlockPreconditioner``)."""
    plans = []
    for pg, units in by_pg.items():
        ranges, owners, costs = [], [], []
        for item, t in units:
            assert item.blocks is not None
            ranges.append(item.blocks.ranges[t])
            owners.append(item.blocks.owners[t])
            costs.append(root_cost(item.blocks.tiles[t]))
        planned = tuple(units)

        def unit_name(i: int, planned: tuple[tuple[BlockItem, int], ...] = planned) -> str:
            return f"{planned[i][0].name} tile {planned[i][1]}"

        owner_exchange = exchange.plan_owner_exchange(
            pg,
            units[0][0].layout.coord,
            ranges,
            owners,
            weights=costs,
            dtype=torch.float32,
            device=local_flat(units[0][0].param, units[0][0].name).device,
            bucket_cap_mb=bucket_cap_mb,
            check=check,
            what=what,
            names=unit_name,
            description=[
                (i.layout.global_shape, t, i.blocks.ranges[t] if i.blocks else ()) for i, t in units
            ],
            tensors=sorted({i.name for i, _ in units}),
            count=len(units),
        )
        plans.append((planned, owner_exchange))
    return plans


def preconditioned(group: dict[str, Any], param: torch.Tensor) -> bool:
    """``use_preconditioner`` of the group, or (``None``) whether ``param`` has 2+ dims."""
    use = group["use_preconditioner"]
    return (param.dim() >= 2) if use is None else bool(use)


def check_max_dim(name: str, known: Blocks, group: dict[str, Any]) -> None:
    """The tiles of a parameter hold its state: their size cannot change afterwards."""
    if known.max_dim != int(group["max_preconditioner_dim"]):
        raise ValueError(
            f"parameter {name!r}: max_preconditioner_dim changed from "
            f"{known.max_dim} to {group['max_preconditioner_dim']} after its "
            f"tiles were made; the tiles hold its state (make a new optimizer)"
        )


def check_local_grad(name: str, grad: torch.Tensor, layout: ParamLayout) -> None:
    """A local gradient sharded like its parameter."""
    if grad.numel() != layout.local_numel:
        raise ValueError(
            f"parameter {name!r}: its local gradient has {grad.numel()} elements but "
            f"the parameter's local shard ({layout.placement}) has "
            f"{layout.local_numel}; the gradient must be sharded like the parameter"
        )
