"""What Shampoo and SOAP share: tiles on owners, the owner exchange, sharded block state.

[Note: distributed block preconditioning]
A preconditioned parameter is a matrix cut into tiles (``tiles.py``). Every tile has one owner
rank that keeps all of the tile's state (statistics, roots or eigenbases, moments) and computes
its update direction ``U`` from the tile's whole gradient. Per step:

1. tiles whole on this rank (all of them under the optimizers' block policy) are computed here
   from the local gradient, with no communication;
2. tiles cut by a rank boundary: one uneven all-to-all per process group (all tiles of all
   parameters batched) carries each rank's pieces to the owners (``exchange.py``, tiles in the
   place of matrices); while it flies, step 1 and the elementwise parameters proceed;
3. the owners compute ``U`` of their cut tiles and one more all-to-all returns each rank its
   pieces of ``U``;
4. every rank applies its local piece of ``U`` (learning rate, weight decay) elementwise.

No tile is ever gathered on more than its owner: traffic is at most 2x the cut tiles' fp32 bytes.
A tile's math sees a fresh contiguous fp32 copy of its gradient wherever it runs, and the
elementwise steps use only correctly rounded ops, so results are bit-identical to one device.

[Note: block state in checkpoints]
The state of tile ``t`` is kept under keys ``block{t}_{name}`` only on its owner. ``state_dict()``
gives every rank every key: a DTensor of the block's global shape placed ``RaggedShard((), one-hot
owner)`` on the sharding axis (the owner holds it all, the others an empty piece), so DCP saves
each block once and, loading into another layout or world size, delivers it to the new owner.
Elementwise state (parameters below 2 dims) has the parameter's own placements.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from optim_blockwise._private import exchange
from optim_blockwise._private.agree import check_agreement, fingerprint
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.layout import ParamLayout, describe, local_flat
from optim_blockwise._private.state import restore_state_dtypes, sharded_state_dict
from optim_blockwise._private.tiles import (
    Piece,
    PreconditionerBlockPolicy,
    Tile,
    assign_owners,
    matrix_shape,
    piece_of,
    read_piece,
    root_cost,
    tile_ranges,
    tiles_of,
    write_piece,
)
from ragged_dtensor import RaggedShard

__all__ = ["BlockPreconditioner", "BlockItem", "dtype_name", "as_dtype", "block_key"]

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
class _Blocks:
    """A preconditioned parameter's tiles, their per-rank ranges, owners and this rank's pieces."""

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
    blocks: _Blocks | None
    """None: updated elementwise (below 2 dims, or ``use_preconditioner=False``)."""


class BlockPreconditioner(ShardedOptimizer):
    """Base of ``Shampoo`` and ``SOAP``: see the module notes. Subclasses give the math."""

    _ELEMENTWISE_KIND = "elementwise"

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.check_consistency = True
        self._layouts: dict[torch.Tensor, ParamLayout] = {}
        self._blocks: dict[torch.Tensor, _Blocks] = {}
        self._load: dict[object, list[int]] = {}
        self._plans: dict[tuple[object, ...], tuple[exchange.ExchangePlan, int]] = {}
        self.root_fallbacks = 0
        """Root / eigenbasis computations that failed in float32 and float64 (previous kept)."""
        self.last_step_stats: dict[str, int] = {}
        """Collectives, bytes sent and tiles computed by this rank in the last step."""
        for gi, group in enumerate(self.param_groups):
            if group["use_preconditioner"] is True:
                for index, p in enumerate(group["params"]):
                    if p.dim() < 2:
                        raise ValueError(
                            f"param_groups[{gi}] has use_preconditioner=True but parameter "
                            f"{self._name(group, index, p)!r} has shape {tuple(p.shape)}; "
                            f"preconditioning needs 2 or more dims (put it in a group with "
                            f"use_preconditioner=False)"
                        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "preconditioner_dtype" in param_group:
            name = dtype_name(param_group["preconditioner_dtype"], "preconditioner_dtype")
            param_group = {**param_group, "preconditioner_dtype": name}
        if int(param_group.get("max_preconditioner_dim", 1)) < 1:
            raise ValueError(
                f"max_preconditioner_dim must be >= 1, got {param_group['max_preconditioner_dim']}"
            )
        super().add_param_group(param_group)

    @staticmethod
    def block_policy(max_preconditioner_dim: int = 1024) -> PreconditionerBlockPolicy:
        """The engine's block policy keeping every tile whole on one rank (see tiles.py)."""
        return PreconditionerBlockPolicy(max_preconditioner_dim)

    # -- subclass hooks ----------------------------------------------------------------------
    def _block_spec(self, group: dict[str, Any], tile: Tile) -> StateSpec:
        raise NotImplementedError

    def _init_block(self, group: dict[str, Any], tile: Tile, device: torch.device) -> dict[str, Any]:
        spec = self._block_spec(group, tile)
        return {k: torch.zeros(s, dtype=d, device=device) for k, (s, d) in spec.items()}

    def _direction(
        self, group: dict[str, Any], state: dict[str, torch.Tensor], grad: torch.Tensor, step: int
    ) -> torch.Tensor:
        """The tile's update direction (``rows x cols`` fp32) from its whole fp32 gradient."""
        raise NotImplementedError

    def _apply(self, item: BlockItem, update: torch.Tensor, step: int) -> None:
        """Apply this rank's flat fp32 ``update`` of a preconditioned parameter."""
        raise NotImplementedError

    def _restore_layout(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A loaded block tensor in the memory layout the step keeps it in (default: rows).

        Strides select the matmul kernel, hence the rounding: a state tensor must come back
        from a checkpoint with the strides it had, or the continued run differs in the last
        bits from an uninterrupted one.
        """
        return value

    def _elementwise(self, item: BlockItem, step: int) -> None:
        raise NotImplementedError

    # -- layouts, tiles, owners ----------------------------------------------------------------
    def _preconditioned(self, group: dict[str, Any], param: torch.Tensor) -> bool:
        use = group["use_preconditioner"]
        return (param.dim() >= 2) if use is None else bool(use)

    def _ensure_blocks(self) -> None:
        """Tiles and owners of every preconditioned parameter (with or without a gradient).

        Owners must not depend on which parameters have gradients this step: the owner keeps
        the tile's state. New parameters are assigned on top of the load already owned.
        """
        new: dict[object, list[tuple[torch.Tensor, ParamLayout, tuple[int, int], int]]] = {}
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                if param in self._blocks or not self._preconditioned(group, param):
                    continue
                name = self._name(group, index, param)
                layout = self._layout(param, name)
                shape2 = matrix_shape(layout.global_shape)
                assert shape2 is not None
                key = layout.group if layout.is_sharded else None
                new.setdefault(key, []).append(
                    (param, layout, shape2, int(group["max_preconditioner_dim"]))
                )
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
            load = self._load.setdefault(key, [0] * world)
            owners = assign_owners(
                [root_cost(tile) for _, _, tile in flat],
                [[b - a for a, b in r] for r in ranges],
                world,
                load,
            )
            pos = 0
            for e, (param, layout, shape2, _max) in enumerate(entries):
                tiles = per_entry[e]
                n = len(tiles)
                coord = layout.coord if key is not None else 0
                start = layout.start if key is not None else 0
                rr = tuple(ranges[pos : pos + n])
                pieces = tuple(
                    piece_of(tile, shape2[1], start, *rr[t][coord]) for t, tile in enumerate(tiles)
                )
                self._blocks[param] = _Blocks(shape2[1], tiles, rr, owners[pos : pos + n], pieces)
                pos += n

    def _items(self) -> list[BlockItem]:
        self._ensure_blocks()
        out = []
        for group, name, param in self._params_with_grads():
            layout = self._layout(param, name)
            out.append(BlockItem(param, name, group, layout, self._blocks.get(param)))
        return out

    def _step_count(self, item: BlockItem) -> int:
        state = cast(dict[str, Any], self.state[item.param])
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["step"] += 1
        return int(state["step"].item())

    def _tile_state(self, item: BlockItem, t: int, device: torch.device) -> dict[str, Any]:
        state = cast(dict[str, Any], self.state[item.param])
        assert item.blocks is not None
        tile = item.blocks.tiles[t]
        spec = self._block_spec(item.group, tile)
        first = block_key(t, next(iter(spec)))
        if first not in state:
            for k, v in self._init_block(item.group, tile, device).items():
                state[block_key(t, k)] = v
        return {k: state[block_key(t, k)] for k in spec}

    def _compute(
        self, item: BlockItem, t: int, grad: torch.Tensor, step: int
    ) -> torch.Tensor:
        """``U`` of tile ``t`` (flat fp32) on its owner; the tile's state is updated."""
        assert item.blocks is not None
        tile = item.blocks.tiles[t]
        tstate = self._tile_state(item, t, grad.device)
        out = self._direction(item.group, tstate, grad.view(tile.shape), step)
        state = cast(dict[str, Any], self.state[item.param])
        for k, v in tstate.items():
            state[block_key(t, k)] = v
        return out.reshape(-1)

    # -- the step ------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items = self._items()
        steps = [self._step_count(item) for item in items]
        stats = {"collectives": 0, "bytes_sent": 0, "local_tiles": 0, "exchanged_tiles": 0}
        fallbacks_before = self.root_fallbacks
        updates: dict[int, torch.Tensor] = {}
        grads: dict[int, torch.Tensor] = {}
        by_pg: dict[object, list[tuple[int, int]]] = {}  # pg -> (item, tile) of cut tiles
        local_tasks: list[tuple[int, int]] = []
        for i, item in enumerate(items):
            if item.blocks is None:
                continue
            assert item.param.grad is not None
            grads[i] = local_flat(item.param.grad, item.name)
            updates[i] = torch.empty(
                item.layout.local_numel, dtype=torch.float32, device=grads[i].device
            )
            coord = item.layout.coord if item.layout.is_sharded else 0
            for t in range(len(item.blocks.tiles)):
                if item.blocks.whole_on(t, coord):
                    local_tasks.append((i, t))
                elif item.blocks.is_cut(t):
                    by_pg.setdefault(item.layout.group, []).append((i, t))

        # 1. start the gathers of the cut tiles (one all-to-all per process group).
        pending = []
        for pg, tasks in by_pg.items():
            assert isinstance(pg, dist.ProcessGroup)
            plan, digest = self._plan(pg, items, tasks)
            device = grads[tasks[0][0]].device
            if self.check_consistency:
                names = sorted({items[i].name for i, _ in tasks})
                check_agreement(pg, digest, len(tasks), device, type(self).__name__, names)
                stats["collectives"] += 1
            pieces = []
            for i, t in tasks:
                blocks = items[i].blocks
                assert blocks is not None
                pieces.append(read_piece(grads[i], blocks.pieces[t], torch.float32))
            work, recv = exchange.gather_to_roots(plan, pieces, pg)
            stats["collectives"] += 1
            stats["bytes_sent"] += plan.moved_elements * 4
            stats["exchanged_tiles"] += len(plan.mine)
            pending.append((pg, tasks, plan, work, recv))

        # Overlap: whole local tiles and elementwise parameters while the gathers fly.
        for i, t in local_tasks:
            blocks = items[i].blocks
            assert blocks is not None
            g = read_piece(grads[i], blocks.pieces[t], torch.float32)
            u = self._compute(items[i], t, g, steps[i])
            write_piece(updates[i], blocks.pieces[t], u)
            stats["local_tiles"] += 1
        for i, item in enumerate(items):
            if item.blocks is None:
                self._elementwise(item, steps[i])

        # 2. the owners compute their cut tiles; 3. scatter the directions back.
        scatters = []
        for pg, tasks, plan, work, recv in pending:
            if work is not None:
                work.wait()
            full = exchange.assemble(plan, recv)
            results = {
                j: self._compute(items[tasks[j][0]], tasks[j][1], full[j], steps[tasks[j][0]])
                for j in plan.mine
            }
            like = grads[tasks[0][0]].new_empty(0, dtype=torch.float32)
            work2, recv2 = exchange.scatter_from_roots(plan, results, like, pg)
            stats["collectives"] += 1
            stats["bytes_sent"] += plan.moved_elements * 4
            scatters.append((tasks, plan, work2, recv2))
        for tasks, plan, work2, recv2 in scatters:
            if work2 is not None:
                work2.wait()
            back = exchange.split_scattered(plan, recv2)
            for j, (i, t) in enumerate(tasks):
                blocks = items[i].blocks
                assert blocks is not None
                write_piece(updates[i], blocks.pieces[t], back[j])

        # 4. apply.
        for i, update in updates.items():
            self._apply(items[i], update, steps[i])
        stats["root_fallbacks"] = self.root_fallbacks - fallbacks_before
        self.last_step_stats = stats
        return loss

    def _plan(
        self, pg: dist.ProcessGroup, items: list[BlockItem], tasks: list[tuple[int, int]]
    ) -> tuple[exchange.ExchangePlan, int]:
        key = (pg, *((items[i].param, t) for i, t in tasks))
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        coord = items[tasks[0][0]].layout.coord
        ranges = []
        owners = []
        described = []
        for i, t in tasks:
            blocks = items[i].blocks
            assert blocks is not None
            ranges.append(blocks.ranges[t])
            owners.append(blocks.owners[t])
            described.append((items[i].layout.global_shape, t, blocks.ranges[t]))
        plan = exchange.plan_exchange(coord, ranges, owners)
        cached = (plan, fingerprint(described))
        self._plans[key] = cached
        return cached

    # -- state dict ----------------------------------------------------------------------------
    def _pairs(self, saved_groups: list[dict[str, Any]]) -> list[tuple[Any, dict[str, Any], Any]]:
        out = []
        params = [(g, p) for g in self.param_groups for p in g["params"]]
        ids = [pid for g in saved_groups for pid in g["params"]]
        for pid, (group, param) in zip(ids, params, strict=True):
            out.append((pid, group, param))
        return out

    def state_dict(self) -> dict[str, Any]:
        """torch's format; DTensor params' state as DTensors (see the module notes)."""
        self._ensure_blocks()
        raw = super().state_dict()
        blocks_of: dict[Any, dict[str, torch.Tensor]] = {}
        plain: dict[Any, dict[str, Any]] = {}
        for pid, entry in raw["state"].items():
            plain[pid] = {k: v for k, v in entry.items() if not k.startswith("block")}
            blocks_of[pid] = {k: v for k, v in entry.items() if k.startswith("block")}
        out = sharded_state_dict(self, {**raw, "state": plain})
        for pid, group, param in self._pairs(raw["param_groups"]):
            if pid not in out["state"]:
                continue
            blocks = self._blocks.get(param)
            if blocks is None:
                continue
            entry = dict(out["state"][pid])
            entry.update(self._block_entries(group, param, blocks, blocks_of[pid]))
            out["state"][pid] = entry
        return out

    def _block_entries(
        self,
        group: dict[str, Any],
        param: torch.Tensor,
        blocks: _Blocks,
        have: dict[str, torch.Tensor],
    ) -> dict[str, torch.Tensor]:
        sharded = isinstance(param, DTensor) and any(
            not isinstance(p, Replicate) for p in param.placements
        )
        out: dict[str, torch.Tensor] = {}
        device = (param.to_local() if isinstance(param, DTensor) else param).device
        for t, tile in enumerate(blocks.tiles):
            for name, (shape, dtype) in self._block_spec(group, tile).items():
                key = block_key(t, name)
                value = have.get(key)
                if not sharded:
                    if value is not None:
                        out[key] = value
                    continue
                assert isinstance(param, DTensor)
                local = (
                    value.reshape(-1)
                    if value is not None
                    else torch.empty(0, dtype=dtype, device=device)
                )
                axis = next(
                    a for a, p in enumerate(param.placements) if not isinstance(p, Replicate)
                )
                onehot = tuple(int(k == blocks.owners[t]) for k in range(param.device_mesh.size(axis)))
                placements: list[Placement] = [Replicate()] * len(param.placements)
                placements[axis] = RaggedShard((), onehot)
                out[key] = DTensor.from_local(
                    local,
                    param.device_mesh,
                    placements,
                    shape=torch.Size(shape),
                    stride=_contiguous_stride(shape),
                    run_check=False,
                )
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_state_dtypes(self, state_dict, super().load_state_dict)
        self._ensure_blocks()
        for group in self.param_groups:
            for param in group["params"]:
                blocks = self._blocks.get(param)
                state = cast(dict[str, Any], self.state.get(param, {}))
                if blocks is None or not state:
                    continue
                layout = self._layouts[param]
                coord = layout.coord if layout.is_sharded else 0
                for t, tile in enumerate(blocks.tiles):
                    for name, (shape, _dtype) in self._block_spec(group, tile).items():
                        key = block_key(t, name)
                        if key not in state:
                            continue
                        value = state[key]
                        if value.numel() == 0 or blocks.owners[t] != coord:
                            del state[key]  # another rank's block
                            continue
                        if value.numel() != math.prod(shape):
                            raise ValueError(
                                f"optimizer state {key!r}: {value.numel()} elements, expected "
                                f"shape {shape} (was the checkpoint saved with another "
                                f"max_preconditioner_dim?)"
                            )
                        state[key] = self._restore_layout(name, value.view(shape))


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    return tuple(reversed(stride))
