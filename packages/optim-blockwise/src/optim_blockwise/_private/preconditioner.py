"""What Shampoo and SOAP share: tiles on owners, the owner exchange, sharded block state.

[Note: distributed block preconditioning]
A preconditioned parameter is a matrix cut into tiles (``tiles.py``). Every tile has one owner
rank that keeps all of the tile's state (statistics, roots or eigenbases, moments) and computes
its update direction ``U`` from the tile's whole gradient. Per step:

1. tiles whole on this rank (all of them under the optimizers' block policy) are computed here
   from the local gradient, with no communication, while the first buckets of step 2 fly;
2. tiles cut by a rank boundary go through the owner exchange (``exchange.run``: tiles are its
   units; per process group, all cut tiles of all parameters in buckets of ``bucket_cap_mb``,
   two buckets in flight against the owners' math): each rank's pieces to the owner, the
   owner's ``U`` back;
3. every rank applies its local piece of ``U`` (learning rate, weight decay) elementwise.

No tile is ever gathered on more than its owner: traffic is at most 2x the cut tiles' fp32 bytes.
The exchange plan covers every trainable preconditioned parameter whether or not it has a
gradient this step, so it is made (and agreed between ranks, one small all-gather) only when the
parameter set changes; a gradient present on some ranks only travels as a presence flag and
raises on every rank (``exchange``'s presence note): no per-step host synchronization.
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

from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from optim_blockwise._private import exchange
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.precond_plan import (
    BlockItem,
    Blocks,
    StateSpec,
    as_dtype,
    block_key,
    check_local_grad,
    check_max_dim,
    dtype_name,
    make_blocks,
    plan_exchanges,
    preconditioned,
)
from optim_blockwise._private.precond_state import block_entries, restore_blocks, saved_pairs
from optim_blockwise._private.precond_step import run_exchange
from optim_blockwise._private.state import sharded_state_dict
from optim_blockwise._private.tiles import (
    PreconditionerBlockPolicy,
    Tile,
    matrix_shape,
    read_piece,
    write_piece,
)

__all__ = ["BlockPreconditioner", "BlockItem", "dtype_name", "as_dtype", "block_key"]


class BlockPreconditioner(ShardedOptimizer):
    """Base of ``Shampoo`` and ``SOAP``: see the module notes. Subclasses give the math."""

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any]) -> None:
        super().__init__(params, defaults)
        self.check_consistency = True
        self._blocks: dict[torch.Tensor, Blocks] = {}
        self._load: dict[object, list[int]] = {}
        self._exchanges: list[tuple[tuple[tuple[BlockItem, int], ...], exchange.OwnerExchange]] = []
        self.bucket_cap_mb = 1.0
        """Payload of one bucket of the owner exchange (buckets pipeline against the math)."""
        self.in_flight = 2
        """Gathers kept ahead of the owners' compute."""
        self._fallbacks: dict[torch.device, torch.Tensor] = {}
        """Per device: refreshes that kept the previous root / eigenbasis, counted there."""
        self._fallbacks_before: dict[torch.device, torch.Tensor] = {}
        self._stats: dict[str, int] = {}
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

    # -- root fallbacks (roots.py's numerical guards: decided and counted on the device) ----
    def _note_fallback(self, failed: torch.Tensor) -> None:
        """Count one refresh that kept the previous root or basis (``failed``: a 0-dim device
        flag): a device-side add, never a host read."""
        total = self._fallbacks.get(failed.device)
        if total is None:
            total = torch.zeros((), dtype=torch.int64, device=failed.device)
            self._fallbacks[failed.device] = total
        total.add_(failed)

    @property
    def root_fallbacks(self) -> int:
        """Root / eigenbasis refreshes whose result was not finite (the previous one kept).

        Counted on the device: reading this property reads the count (the step never does)."""
        return sum(int(t.item()) for t in self._fallbacks.values())

    @property
    def last_step_stats(self) -> dict[str, int]:
        """Collectives, bytes sent and tiles computed by this rank in the last step, and its
        root fallbacks (read from the device when this property is read)."""
        before = sum(int(t.item()) for t in self._fallbacks_before.values())
        return {**self._stats, "root_fallbacks": self.root_fallbacks - before}

    # -- subclass hooks ----------------------------------------------------------------------
    def _block_spec(self, group: dict[str, Any], tile: Tile) -> StateSpec:
        raise NotImplementedError

    def _init_block(
        self, group: dict[str, Any], tile: Tile, device: torch.device
    ) -> dict[str, Any]:
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
    def _ensure_blocks(self) -> None:
        """Tiles and owners of every preconditioned parameter (with or without a gradient).

        Owners must not depend on which parameters have gradients this step: the owner keeps
        the tile's state. New parameters are assigned on top of the load already owned.
        """
        new: dict[
            dist.ProcessGroup | None, list[tuple[torch.Tensor, ParamLayout, tuple[int, int], int]]
        ] = {}
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                if not preconditioned(group, param):
                    continue
                name = self._name(group, index, param)
                known = self._blocks.get(param)
                if known is not None:
                    check_max_dim(name, known, group)
                    continue
                layout = self._layout(param, name)
                shape2 = matrix_shape(layout.global_shape)
                assert shape2 is not None
                key = layout.group if layout.is_sharded else None
                new.setdefault(key, []).append(
                    (param, layout, shape2, int(group["max_preconditioner_dim"]))
                )
        for param, blocks in make_blocks(new, self._load).items():
            self._blocks[param] = blocks

    def _items(self) -> list[BlockItem]:
        """Every parameter with a gradient, in group order (tiles attached when preconditioned)."""
        self._ensure_blocks()
        out = []
        for group, name, param in self._params_with_grads():
            layout = self._layout(param, name)
            assert param.grad is not None
            grad = local_flat(param.grad, name)
            check_local_grad(name, grad, layout)
            out.append(BlockItem(param, name, group, layout, self._blocks.get(param)))
        return out

    def _count_step(self, items: list[BlockItem]) -> dict[torch.Tensor, int]:
        """Each item's step number, this step included (host counts, no device read)."""
        entries = []
        for item in items:
            state = cast(dict[str, Any], self.state[item.param])
            if "step" not in state:
                self._new_step_count(item.param, state)
            entries.append((item.param, state))
        self._count_steps(entries)
        return {p: int(self._steps_done(p, state)) for p, state in entries}

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

    def _compute(self, item: BlockItem, t: int, grad: torch.Tensor, step: int) -> torch.Tensor:
        """``U`` of tile ``t`` (flat fp32) on its owner; the tile's state is updated."""
        assert item.blocks is not None
        tile = item.blocks.tiles[t]
        tstate = self._tile_state(item, t, grad.device)
        out = self._direction(item.group, tstate, grad.view(tile.shape), step)
        state = cast(dict[str, Any], self.state[item.param])
        for k, v in tstate.items():
            state[block_key(t, k)] = v
        return out.reshape(-1)

    # -- the exchange plan ---------------------------------------------------------------------
    def _plan_inputs(self) -> tuple[object, ...]:
        """Everything the exchange plans depend on; cheap, reads nothing from the device."""
        key: list[object] = [self.bucket_cap_mb, self.check_consistency]
        for group in self.param_groups:
            key.append((group["use_preconditioner"], group["max_preconditioner_dim"]))
            key.extend((id(p), p.requires_grad) for p in group["params"])
        return tuple(key)

    def _make_plan(self) -> None:
        """One exchange per process group over the cut tiles of every trainable preconditioned
        parameter (present or not in a given step, see exchange's presence note); the ranks
        check once, here, that they planned the same exchange."""
        self._ensure_blocks()
        by_pg: dict[dist.ProcessGroup, list[tuple[BlockItem, int]]] = {}
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                blocks = self._blocks.get(param)
                if blocks is None or not param.requires_grad:
                    continue
                name = self._name(group, index, param)
                layout = self._layout(param, name)
                if not layout.is_sharded:
                    continue
                item = BlockItem(param, name, group, layout, blocks)
                assert layout.group is not None
                for t in range(len(blocks.tiles)):
                    if blocks.is_cut(t):
                        by_pg.setdefault(layout.group, []).append((item, t))
        self._exchanges = plan_exchanges(
            by_pg,
            bucket_cap_mb=self.bucket_cap_mb,
            check=self.check_consistency,
            what=type(self).__name__,
        )

    # -- the step ------------------------------------------------------------------------------
    def _step(self) -> None:
        items = self._items()
        steps = self._count_step(items)
        stats = {"collectives": 0, "bytes_sent": 0, "local_tiles": 0, "exchanged_tiles": 0}
        self._fallbacks_before = {d: t.clone() for d, t in self._fallbacks.items()}
        updates: dict[torch.Tensor, torch.Tensor] = {}
        grads: dict[torch.Tensor, torch.Tensor] = {}
        for item in items:
            if item.blocks is not None:
                assert item.param.grad is not None
                grads[item.param] = local_flat(item.param.grad, item.name)
                updates[item.param] = torch.empty(
                    item.layout.local_numel, dtype=torch.float32, device=grads[item.param].device
                )

        def overlap() -> None:
            # Whole local tiles and elementwise parameters: no owner elsewhere needed.
            for item in items:
                if item.blocks is None:
                    self._elementwise(item, steps[item.param])
                    continue
                coord = item.layout.coord if item.layout.is_sharded else 0
                for t in range(len(item.blocks.tiles)):
                    if item.blocks.whole_on(t, coord):
                        piece = item.blocks.pieces[t]
                        g = read_piece(grads[item.param], piece, torch.float32)
                        u = self._compute(item, t, g, steps[item.param])
                        write_piece(updates[item.param], piece, u)
                        stats["local_tiles"] += 1

        if not self._exchanges:
            overlap()
        for n, (units, owner_exchange) in enumerate(self._exchanges):
            first = overlap if n == 0 else None  # runs once the first gathers are in flight
            run = run_exchange(
                units, owner_exchange, grads, steps, updates, self._compute, self.in_flight, first
            )
            stats["collectives"] += run.collectives
            stats["bytes_sent"] += run.bytes_sent
            stats["exchanged_tiles"] += len(owner_exchange.plan.mine)
        for item in items:
            if item.param in updates:
                self._apply(item, updates[item.param], steps[item.param])
        self._stats = stats

    # -- state dict ----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """torch's format; DTensor params' state as DTensors (see the module notes)."""
        self._ensure_blocks()
        raw = torch.optim.Optimizer.state_dict(self)
        blocks_of: dict[Any, dict[str, torch.Tensor]] = {}
        plain: dict[Any, dict[str, Any]] = {}
        for pid, entry in raw["state"].items():
            plain[pid] = {k: v for k, v in entry.items() if not k.startswith("block")}
            blocks_of[pid] = {k: v for k, v in entry.items() if k.startswith("block")}
        out = sharded_state_dict(self, {**raw, "state": plain})
        for pid, group, param in saved_pairs(self.param_groups, raw["param_groups"]):
            if pid not in out["state"]:
                continue
            blocks = self._blocks.get(param)
            if blocks is None:
                continue
            entry = dict(out["state"][pid])
            entry.update(block_entries(self._block_spec, group, param, blocks, blocks_of[pid]))
            out["state"][pid] = entry
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._ensure_blocks()
        for group in self.param_groups:
            for param in group["params"]:
                blocks = self._blocks.get(param)
                state = cast(dict[str, Any], self.state.get(param, {}))
                if blocks is None or not state:
                    continue
                restore_blocks(
                    self._block_spec,
                    self._restore_layout,
                    group,
                    blocks,
                    self._layouts[param],
                    state,
                )
