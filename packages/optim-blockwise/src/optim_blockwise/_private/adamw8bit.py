"""AdamW with blockwise dynamic 8-bit moments, on plain tensors and sharded parameters.

[Note: bit-identical sharded and single-device results]
Every operation of the update is elementwise in fp32 given a block's absmax, and the absmax is a
max (exact, order-free). The arithmetic avoids fused multiply-adds (no ``alpha=``, ``addcdiv``,
``lerp``) because the CPU kernels fuse in their vectorized body and not in the scalar tail, which
would make an element's result depend on its position in memory, i.e. on the shard it sits in.
Quantization blocks are counted from the *global* flat index, and the 8-bit/fp32 state decision
is made on the global numel, so a shard computes exactly the bytes the whole tensor would.

[Note: shards that cut a quantization block]
With a block-aligned sharding (a block policy from ``AdamW8bit.block_policy``) no rank boundary
cuts a block and the step issues no collective. Otherwise (e.g. FSDP2's ``Shard(0)`` with a row
length that is not a multiple of the block) at most the first and last local blocks of a rank
are shared with neighbours; their absmax is the max of the neighbours' partial maxima. Those are
computed first from just those elements, exchanged in one ``all_gather`` of 5 floats per
parameter per step (the 4 partial maxima and a presence flag, batched over all such parameters
of a process group), and every rank stores the whole block's absmax. Results stay bit-identical
to single device; nothing else moves.

Which parameters take part is decided once per layout (``_make_plan``), for every parameter
whose shards cut blocks whether or not it has a gradient in a given step, and only then do the
ranks check with the fingerprint all-gather every package shares (``agree``) that they planned
the same exchange: a disagreement is an error instead of a gloo abort, and a steady-state step
runs no agreement collective and reads nothing on the host. A gradient present on some ranks
only travels as its presence flag and raises on every rank (``exchange.check_presence``, a
device-side assert), as in Muon's exchange.

[Note: runs, chunks and memory]
Parameters that lie next to each other in one storage (a ``fully_shard`` group's flat shard) and
share a param group, a state kind (8-bit or fp32) and a step count form a *run* (see ``runs``):
one flat view of the parameters, of the gradients, of the codes and absmaxes (the state lives in
one flat buffer per storage, ``state[p]`` holds views), so the ~50 kernels of an update run once
per chunk of a run instead of once per parameter. For 8-bit runs every parameter but the last
must end on a block boundary and every one but the first start on one, so the run is one grid
of blocks (block-aligned shards from the block policy give exactly that).

Each run is processed in chunks of whole blocks with one set of scratch buffers reused for every
chunk (``quant.Scratch``: ~25 bytes per chunk element), the codes and absmaxes written in place.
The chunk is sized from the step's total local elements so the transient memory of ``step()``
stays below ~3 bytes per element beyond the stored state (capped at ``2**20`` elements: at scale
the scratch is a small constant), instead of ~40 bytes per element for dequantize-update-
quantize on whole tensors.

[Note: non-finite gradients]
As in ``torch.optim.AdamW`` nothing is checked: a NaN/Inf gradient element makes that element's
parameter NaN on that step. Because the moments are stored per block, the block's absmax
becomes NaN/Inf and the whole block's moments are lost (NaN) from then on, which then spreads to
the block's parameters on the next step (bitsandbytes and torchao behave the same way). Skip such
steps before ``step()`` (``torch.amp.GradScaler`` does).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from optim_blockwise._private import quant
from optim_blockwise._private.agree import check_agreement, fingerprint
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.exchange import PresenceFlags, check_presence, presence_status
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.policy import (
    AdamW8bitBlockPolicy,
    BlockPolicy,
    adamw8bit_settings,
    check_adamw8bit_blocks,
    check_recorded_policy,
)
from optim_blockwise._private.runs import (
    Run,
    Slot,
    compact,
    flat_view,
    group_runs,
    local_of,
    slot_of,
)
from optim_blockwise._private.validate import check_betas, check_nonnegative
from ragged_dtensor import RaggedShard

__all__ = ["AdamW8bit", "adamw8bit_block_policy"]

_CHUNK_CAP = 2**20  # elements: the scratch stays ~25 MiB however large the model
_SCRATCH_PER_ELEMENT = 25  # bytes of quant.Scratch per chunk element
_TARGET_TRANSIENT = 3  # bytes per stepped element (the bound is 4)
_EIGHT_BIT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
_FP32_KEYS = ("exp_avg", "exp_avg_sq")


def adamw8bit_block_policy(
    block_size: int = 256, min_8bit_size: int = 4096
) -> AdamW8bitBlockPolicy:
    """A block policy keeping shards on quantization blocks (see ``AdamW8bitBlockPolicy``)."""
    return AdamW8bitBlockPolicy(block_size, min_8bit_size)


def _moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> None:
    """In place: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2`` (unfused, see Note)."""
    m.mul_(beta1).add_(g * (1.0 - beta1))
    v.mul_(beta2).add_(g.mul(g).mul_(1.0 - beta2))


def _moments_into(
    m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float, tmp: torch.Tensor
) -> None:
    """``_moments`` with its temporaries in ``tmp`` (scratch): the same ops, in the same order."""
    m.mul_(beta1).add_(torch.mul(g, 1.0 - beta1, out=tmp))
    v.mul_(beta2).add_(torch.mul(g, g, out=tmp).mul_(1.0 - beta2))


@attrs.frozen(eq=False)
class _Item:
    """One parameter's view for one step."""

    param: torch.Tensor
    name: str
    group: dict[str, Any]
    layout: ParamLayout
    eight_bit: bool
    exchange: bool
    """Its shards cut quantization blocks: boundary absmaxes are exchanged."""


@attrs.frozen(eq=False)
class _Place:
    """Where a parameter's data and state live (made once per layout)."""

    slot: Slot
    eight_bit: bool
    head: int
    """Offset of its first local element inside its first quantization block."""
    blocks: int
    """Quantization blocks its local elements touch."""
    offset: int
    """Element offset of its state in the flat state buffers of its storage."""
    block_offset: int
    """Block offset of its absmaxes in the flat absmax buffers of its storage."""


def _cuts_blocks(layout: ParamLayout, block: int) -> bool:
    return any(lo % block for lo, hi in layout.ranges if hi > lo)


def _replicated(param: DTensor) -> bool:
    return all(isinstance(p, Replicate) for p in param.placements)


class AdamW8bit(ShardedOptimizer):
    """AdamW whose moments are stored in 8 bits with blockwise dynamic quantization.

    ``m`` uses the signed dynamic map, ``v`` the unsigned one, each block of ``block_size``
    consecutive elements (counted from the start of the *global* tensor; the last block of a
    tensor may be shorter) has one fp32 absmax; the update is computed in fp32. Tensors with
    fewer than ``min_8bit_size`` elements (decided on the global shape) keep fp32 moments, as
    bitsandbytes and torchao do.

    Works on plain tensors, ``RaggedShard`` DTensors and FSDP2 ``Shard(0)`` DTensors; with
    block-aligned shards it issues no collective. Parameters that are consecutive views of one
    storage (a ``fully_shard`` group) are updated as one flat run, in bounded chunks (module
    note). ``state_dict()`` holds each rank's local state (codes ``uint8``, absmaxes ``fp32``)
    as DTensors for sharded parameters (resharded by distributed checkpointing).

    ``block_policy``: the block policy the parameters were sharded with (give the engine and the
    optimizer the same ``AdamW8bit.block_policy(...)``). The optimizer then takes ``block_size``
    and ``min_8bit_size`` from it; settings also given must be compatible with it (for every
    tensor kept in 8 bits, the policy's block is a multiple of ``gcd(numel, block_size)``: a
    ``block_size`` dividing the policy's with a ``min_8bit_size`` at least the policy's always
    is), and layouts must not cut its blocks, or construction refuses. A parameter carrying the
    policy it was sharded with (``param.block_policy``, recorded by ``fsdp_engine.fully_shard``)
    that is not compatible with the optimizer's settings is refused too, naming both values.
    Without either, a ``RaggedShard`` layout that cuts the blocks is reported with a warning
    (the policy module's agreement note).

    State memory: 2 bytes per element plus ``8 / block_size`` bytes of absmax (2.03 at 256).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int | None = None,
        min_8bit_size: int | None = None,
        block_policy: BlockPolicy | None = None,
    ) -> None:
        check_nonnegative("lr", lr)
        check_betas("betas", betas)
        check_nonnegative("eps", eps)
        check_nonnegative("weight_decay", weight_decay)
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if block_policy is not None and not callable(block_policy):
            raise TypeError(
                f"block_policy must be a block policy (name, param) -> elements, such as "
                f"AdamW8bit.block_policy(...), got {type(block_policy).__name__}"
            )
        self.block_size, self.min_8bit_size = adamw8bit_settings(
            block_size, min_8bit_size, block_policy
        )
        self._block_policy = block_policy
        self._unaligned: list[str] | None = []  # warnings of the groups given at construction
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self._warn_unaligned(self._unaligned, stacklevel=3)
        self._unaligned = None
        self._places: dict[int, _Place] = {}
        self._places_key: tuple[object, ...] | None = None
        self._buffers: dict[tuple[object, str], torch.Tensor] = {}
        self._boundaries: dict[dist.ProcessGroup, list[tuple[torch.Tensor, str, ParamLayout]]] = {}
        """Per process group, the parameters whose edge absmaxes travel (once per layout)."""
        self._exchanged: set[torch.Tensor] = set()
        self._presence = PresenceFlags()
        self.last_step_stats: dict[str, int] = {}
        """Runs and chunks of the last step, and its scratch size (for benchmarks)."""

    @staticmethod
    def block_policy(block_size: int = 256, min_8bit_size: int = 4096) -> AdamW8bitBlockPolicy:
        """The block policy (engine protocol ``(name, param) -> int``) for these settings."""
        return AdamW8bitBlockPolicy(block_size, min_8bit_size)

    def _absmax_block(self) -> int:
        return self.block_size

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        found = self._check_blocks(self.param_groups[-1])
        if self._unaligned is not None:  # in __init__: warned once, at the caller's line
            self._unaligned.extend(found)
        else:
            self._warn_unaligned(found, stacklevel=3)

    @staticmethod
    def _warn_unaligned(found: list[str], stacklevel: int) -> None:
        if found:
            more = f" ({len(found) - 1} more parameters alike)" if len(found) > 1 else ""
            warnings.warn(found[0] + more, UserWarning, stacklevel=stacklevel)

    def _check_blocks(self, group: dict[str, Any]) -> list[str]:
        """The block policy's agreement with these settings and the layouts (policy module
        note), for the parameters of a new group, at construction (never in a step): raises,
        or returns the warnings' texts."""
        warned = []
        for index, param in enumerate(group["params"]):
            name = self._name(group, index, param)
            layout = None
            if isinstance(param, DTensor) and (
                any(isinstance(p, RaggedShard) for p in param.placements)
                or (self._block_policy is not None and not _replicated(param))
            ):
                layout = self._layout(param, name)
            text = check_adamw8bit_blocks(
                name, param, layout, self.block_size, self.min_8bit_size, self._block_policy
            )
            # after the given policy's check: that one names the policy the caller passed
            check_recorded_policy(name, param, self.block_size, self.min_8bit_size)
            if text is not None:
                warned.append(text)
        return warned

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._adopt()

    # -- where state lives -------------------------------------------------------------------

    def _all_params(self) -> list[tuple[dict[str, Any], str, torch.Tensor]]:
        return [
            (group, self._name(group, index, p), p)
            for group in self.param_groups
            for index, p in enumerate(group["params"])
        ]

    def _current_places(self) -> dict[int, _Place]:
        """Every parameter's place, remade when a parameter's storage moved or was added."""
        everything = self._all_params()
        key = tuple((id(p), local_of(p).data_ptr()) for _, _, p in everything)
        if key != self._places_key:
            old = self._places
            self._places = self._make_places(everything)
            self._places_key = key
            if old and any(
                old.get(pid) is None or old[pid] != place for pid, place in self._places.items()
            ):
                self._adopt()
        return self._places

    def _make_places(
        self, everything: list[tuple[dict[str, Any], str, torch.Tensor]]
    ) -> dict[int, _Place]:
        block = self.block_size
        slots, kinds, heads, blocks = [], [], [], []
        for _, name, p in everything:
            layout = self._layout(p, name)
            n = layout.local_numel
            eight = layout.numel >= self.min_8bit_size
            head = layout.start % block if eight else 0
            slots.append(slot_of(p))
            kinds.append(eight)
            heads.append(head)
            blocks.append(-(-(head + n) // block) if (eight and n) else 0)
        places: dict[int, _Place] = {}
        for eight in (True, False):
            # 8-bit and fp32 state live in separate buffers: compact each kind on its own
            chosen = [i for i, k in enumerate(kinds) if k == eight]
            sub = [slots[i] for i in chosen]
            offsets = compact(sub)
            block_offsets = compact(sub, [blocks[i] for i in chosen])
            for j, i in enumerate(chosen):
                places[id(everything[i][2])] = _Place(
                    slots[i], eight, heads[i], blocks[i], offsets[j], block_offsets[j]
                )
        return places

    def _buffer(self, place: _Place, key: str, length: int) -> torch.Tensor:
        """The flat ``key`` state buffer of ``place``'s storage (made on first use)."""
        bkey = (place.slot.storage, key)
        buf = self._buffers.get(bkey)
        if buf is None:
            per_block = key.endswith("_absmax")
            sizes = [
                (q.block_offset + q.blocks) if per_block else (q.offset + q.slot.numel)
                for q in self._places.values()
                if q.slot.storage == place.slot.storage and q.eight_bit == place.eight_bit
            ]
            device = place.slot.storage[2]
            total = max(sizes, default=0)
            if key.endswith("_codes"):
                signed = key.startswith("exp_avg_codes")
                zero = int((quant.dynamic_map(signed) == 0).nonzero()[0, 0])
                buf = torch.full((total,), zero, dtype=torch.uint8, device=device)
            else:
                buf = torch.zeros(total, dtype=torch.float32, device=device)
            self._buffers[bkey] = buf
        assert buf.numel() >= length
        return buf

    def _views(self, place: _Place, numel: int | None = None) -> dict[str, torch.Tensor]:
        """Flat state slices from ``place``: its own, or with ``numel`` those of a run of
        ``numel`` elements that starts there (absmaxes: the blocks the elements touch)."""
        if numel is None:
            numel, blocks = place.slot.numel, place.blocks
        else:
            blocks = -(-(place.head + numel) // self.block_size)
        out = {}
        for key in _EIGHT_BIT_KEYS if place.eight_bit else _FP32_KEYS:
            lo, n = (
                (place.block_offset, blocks) if key.endswith("_absmax") else (place.offset, numel)
            )
            out[key] = self._buffer(place, key, lo + n)[lo : lo + n]
        return out

    def _init_state(self, item: _Item, place: _Place) -> dict[str, Any]:
        state = cast(dict[str, Any], self.state[item.param])
        if state:
            return state
        self._new_step_count(item.param, state)
        state.update(self._views(place))
        return state

    def _adopt(self) -> None:
        """Copy every parameter's state into the flat buffers of the current places and point
        ``self.state`` at them (after a load, or when parameters moved)."""
        old = {p: dict(s) for p, s in self.state.items()}
        self._buffers = {}
        if self._places_key is None:
            self._places = self._make_places(self._all_params())
            self._places_key = tuple(
                (id(p), local_of(p).data_ptr()) for _, _, p in self._all_params()
            )
        for _, name, p in self._all_params():
            entry = old.get(p)
            if not entry:
                continue
            views = self._views(self._places[id(p)])
            for key, view in views.items():
                value = entry.get(key)
                if not isinstance(value, torch.Tensor):
                    raise ValueError(
                        f"parameter {name!r}: the loaded state has no {key!r} (expected "
                        f"{sorted(views)}: its state kind is decided on the global numel)"
                    )
                src = local_of(value).reshape(-1)
                if src.numel() != view.numel():
                    raise ValueError(
                        f"parameter {name!r}: state {key!r} has {src.numel()} local elements, "
                        f"this layout needs {view.numel()}"
                    )
                view.copy_(src)
                self.state[p][key] = view

    # -- boundary absmax exchange (unaligned shards only) --------------------------------------
    def _boundary_partials(self, item: _Item, state: dict[str, Any]) -> torch.Tensor:
        """[m_head, v_head, m_tail, v_tail]: this rank's partial absmaxes of its edge blocks."""
        layout, block = item.layout, self.block_size
        n, start = layout.local_numel, layout.start
        device = state["exp_avg_absmax"].device
        if n == 0:
            return torch.zeros(4, dtype=torch.float32, device=device)
        beta1, beta2 = item.group["betas"]
        grad = item.param.grad
        assert grad is not None
        g = local_flat(grad, item.name).float()
        out = []
        tail_lo = max(((layout.stop - 1) // block) * block - start, 0)
        for lo, hi, b in ((0, min(n, block - start % block), 0), (tail_lo, n, -1)):
            edge = []
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                code, _ = quant._map_and_midpoints(signed, device)
                edge.append(code[state[f"{key}_codes"][lo:hi].long()] * state[f"{key}_absmax"][b])
            _moments(edge[0], edge[1], g[lo:hi], beta1, beta2)
            out += [edge[0].abs().amax(), edge[1].abs().amax()]
        return torch.stack(out)

    def _exchange_boundaries(
        self, items: list[_Item], states: list[dict[str, Any]]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Global absmax of each exchanged item's first and last local block (m and v): one
        all-gather per process group of every planned parameter's partials and presence."""
        index = {item.param: i for i, item in enumerate(items)}
        result: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        block = self.block_size
        for group, members in self._boundaries.items():
            device = local_of(members[0][0]).device
            present = [param in index for param, _, _ in members]
            absent = torch.zeros(4, dtype=torch.float32, device=device)
            parts = [
                self._boundary_partials(items[index[param]], states[index[param]])
                if param in index
                else absent
                for param, _, _ in members
            ]
            n = len(members)
            flags = self._presence(present, n, torch.float32, device)
            mine = torch.cat([*parts, flags])
            world = dist.get_world_size(group)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine, group=group)
            table = torch.stack(gathered)
            check_presence(
                presence_status(table[:, 4 * n :].sum(0), world),
                range(n),
                "AdamW8bit",
                [name for _, name, _ in members].__getitem__,
            )
            partials = table[:, : 4 * n].view(world, n, 4)
            for j, (param, _, layout) in enumerate(members):
                i = index.get(param)
                if i is None or layout.local_numel == 0:
                    continue  # no gradient (on every rank), or nothing to quantize here
                head_block = layout.start // block
                tail_block = (layout.stop - 1) // block
                # Global absmax of a block = max of every rank's partial max over that block.
                edges = []
                for target in (head_block, tail_block):
                    edge_parts = []
                    for k, (lo, hi) in enumerate(layout.ranges):
                        if hi <= lo:
                            continue
                        if lo // block == target:
                            edge_parts.append(partials[k, j, 0:2])
                        if (hi - 1) // block == target:
                            edge_parts.append(partials[k, j, 2:4])
                    edges.append(torch.stack(edge_parts).amax(dim=0))
                result[i] = (edges[0], edges[1])
        return result

    # -- the step ----------------------------------------------------------------------------
    def _runs(self, items: list[_Item], places: list[_Place]) -> list[Run]:
        """Consecutive items (storage order) that one flat update can serve (module note): one
        param group, state kind and step count, no boundary exchange, and for 8-bit state the
        blocks kept whole (the run is one grid of blocks)."""
        block = self.block_size

        def may_join(prev: int, nxt: int) -> bool:
            before, after = places[prev], places[nxt]
            aligned = after.head == 0 and (before.head + before.slot.numel) % block == 0
            exchanged = items[prev].exchange or items[nxt].exchange
            return not exchanged and (not after.eight_bit or aligned)

        return group_runs(
            [place.slot for place in places],
            [local_of(cast(torch.Tensor, item.param.grad)) for item in items],
            [
                (id(item.group), place.eight_bit, self._step_counts[item.param])
                for item, place in zip(items, places, strict=True)
            ],
            may_join=may_join,
        )

    def _plan_inputs(self) -> tuple[object, ...]:
        key: list[object] = [self.block_size, self.min_8bit_size]
        for group in self.param_groups:
            key.extend(id(p) for p in group["params"])
        return tuple(key)

    def _make_plan(self) -> None:
        """The boundary exchange (module note): every 8-bit parameter whose shards cut
        quantization blocks, per process group, and the ranks' agreement on it."""
        by_group: dict[dist.ProcessGroup, list[tuple[torch.Tensor, str, ParamLayout]]] = {}
        for _, name, param in self._all_params():
            layout = self._layout(param, name)
            if (
                layout.numel >= self.min_8bit_size
                and layout.is_sharded
                and _cuts_blocks(layout, self.block_size)
            ):
                assert layout.group is not None
                by_group.setdefault(layout.group, []).append((param, name, layout))
        for group, members in by_group.items():
            check_agreement(
                group,
                fingerprint([(layout.global_shape, layout.ranges) for _, _, layout in members]),
                len(members),
                local_of(members[0][0]).device,
                "AdamW8bit",
                [name for _, name, _ in members],
            )
        self._boundaries = by_group
        self._exchanged = {param for members in by_group.values() for param, _, _ in members}

    def _step(self) -> None:
        all_places = self._current_places()
        items: list[_Item] = []
        for group, name, param in self._params_with_grads():
            layout = self._layout(param, name)
            assert param.grad is not None
            if param.grad.shape != param.shape:
                raise ValueError(
                    f"parameter {name!r}: gradient shape {tuple(param.grad.shape)} "
                    f"differs from the parameter's {tuple(param.shape)}"
                )
            eight_bit = layout.numel >= self.min_8bit_size
            items.append(_Item(param, name, group, layout, eight_bit, param in self._exchanged))
            for t in (param, param.grad):  # checked like local_flat, without making a view
                if not local_of(t).is_contiguous():
                    local_flat(t, name)
        places = [all_places[id(item.param)] for item in items]
        states = [self._init_state(item, place) for item, place in zip(items, places, strict=True)]
        for item, state in zip(items, states, strict=True):
            self._steps_done(item.param, state)  # read once after a load, before _runs
        edges = self._exchange_boundaries(items, states)
        runs = self._runs(items, places)
        total = sum(r.numel for r in runs)
        block = self.block_size
        chunk = max(block, min(_CHUNK_CAP, total * _TARGET_TRANSIENT // _SCRATCH_PER_ELEMENT))
        chunk = -(-chunk // block) * block
        scratch: quant.Scratch | None = None
        chunks = 0
        for run in runs:
            if run.numel == 0:
                continue
            if scratch is None:
                device = local_of(items[run.members[0]].param).device
                scratch = quant.Scratch(min(chunk, max(total, 1)) + 2 * block, device)
            chunks += self._update_run(run, items, places, states, edges, chunk, scratch)
        self._count_steps([(item.param, state) for item, state in zip(items, states, strict=True)])
        self.last_step_stats = {
            "runs": len(runs),
            "chunks": chunks,
            "scratch_elements": scratch.capacity if scratch is not None else 0,
        }

    def _update_run(
        self,
        run: Run,
        items: list[_Item],
        places: list[_Place],
        states: list[dict[str, Any]],
        edges: dict[int, tuple[torch.Tensor, torch.Tensor]],
        chunk: int,
        scratch: quant.Scratch,
    ) -> int:
        """Update one run in chunks of whole blocks; returns the number of chunks."""
        first = items[run.members[0]]
        place = places[run.members[0]]
        group = first.group
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        step = self._step_counts[first.param] + 1.0
        bias1 = 1.0 - beta1**step
        bias2_sqrt = math.sqrt(1.0 - beta2**step)
        assert first.param.grad is not None
        if len(run.members) == 1:
            p_all = local_flat(first.param, first.name)
            g_all = local_flat(first.param.grad, first.name)
            state = states[run.members[0]]
            views = {k: state[k] for k in (_EIGHT_BIT_KEYS if place.eight_bit else _FP32_KEYS)}
        else:
            p_all = flat_view(local_of(first.param), run.numel)
            g_all = flat_view(local_of(first.param.grad), run.numel)
            views = self._views(place, run.numel)
        block = self.block_size
        head = place.head if place.eight_bit else 0
        edge = edges.get(run.members[0]) if len(run.members) == 1 else None
        n_total = run.numel
        lo, count = 0, 0
        while lo < n_total:
            # chunk boundaries on block boundaries of the run's grid
            if place.eight_bit:
                hi = min(n_total, ((head + lo + chunk) // block) * block - head)
            else:
                hi = min(n_total, lo + chunk)
            self._update_chunk(
                p_all[lo:hi],
                g_all[lo:hi],
                views,
                lo,
                hi,
                head,
                place.eight_bit,
                (beta1, beta2, lr, eps, wd, bias1, bias2_sqrt),
                scratch,
                edge,
                first_chunk=lo == 0,
                last_chunk=hi == n_total,
            )
            lo = hi
            count += 1
        return count

    def _update_chunk(
        self,
        p: torch.Tensor,
        g_in: torch.Tensor,
        views: dict[str, torch.Tensor],
        lo: int,
        hi: int,
        head: int,
        eight_bit: bool,
        hyper: tuple[float, ...],
        scratch: quant.Scratch,
        edge: tuple[torch.Tensor, torch.Tensor] | None,
        *,
        first_chunk: bool,
        last_chunk: bool,
    ) -> None:
        beta1, beta2, lr, eps, wd, bias1, bias2_sqrt = hyper
        n = hi - lo
        block = self.block_size
        f = scratch.f
        p32 = p if p.dtype == torch.float32 else f[3][:n].copy_(p)
        g = g_in if g_in.dtype == torch.float32 else g_in.float()
        if eight_bit:
            h = head if first_chunk else 0
            b_lo = (head + lo) // block
            nb = -(-(h + n) // block)
            m_pad, v_pad = f[0][: nb * block], f[1][: nb * block]
            codes_m = views["exp_avg_codes"][lo:hi]
            codes_v = views["exp_avg_sq_codes"][lo:hi]
            abs_m = views["exp_avg_absmax"][b_lo : b_lo + nb]
            abs_v = views["exp_avg_sq_absmax"][b_lo : b_lo + nb]
            m = quant.dequantize_into(m_pad, codes_m, abs_m, block, h, True, scratch.i[0])
            v = quant.dequantize_into(v_pad, codes_v, abs_v, block, h, False, scratch.i[0])
        else:
            m = views["exp_avg"][lo:hi]
            v = views["exp_avg_sq"][lo:hi]
        p32.mul_(1.0 - lr * wd)
        denom = f[2][:n]
        _moments_into(m, v, g, beta1, beta2, denom)
        torch.sqrt(v, out=denom)
        denom.div_(bias2_sqrt).add_(eps)
        torch.div(m, denom, out=denom)
        p32.sub_(denom.mul_(lr / bias1))
        if p32 is not p:
            p.copy_(p32)
        if not eight_bit:
            return
        quant.absmax_into(abs_m, m_pad, block, h, n, False, f[2])
        quant.absmax_into(abs_v, v_pad, block, h, n, True, f[2])
        if edge is not None:  # blocks shared with neighbouring ranks: the global absmax
            if first_chunk:
                abs_m[0], abs_v[0] = edge[0][0], edge[0][1]
            if last_chunk:
                abs_m[-1], abs_v[-1] = edge[1][0], edge[1][1]
        # v first: its buffer then serves as scratch for m's quantization
        quant.quantize_into(codes_v, v_pad, abs_v, block, h, False, scratch, f[2], f[3])
        quant.quantize_into(codes_m, m_pad, abs_m, block, h, True, scratch, f[2], f[1])
