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

import warnings
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from optim_blockwise._private import quant
from optim_blockwise._private.adamw8bit_chunk import update_run
from optim_blockwise._private.adamw8bit_edges import exchange_boundaries, plan_boundaries
from optim_blockwise._private.adamw8bit_places import Item, Place, make_places, views
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.policy import (
    AdamW8bitBlockPolicy,
    BlockPolicy,
    adamw8bit_settings,
    check_adamw8bit_blocks,
    check_recorded_policy,
)
from optim_blockwise._private.presence import PresenceFlags
from optim_blockwise._private.runs import Run, group_runs, local_of
from optim_blockwise._private.validate import check_betas, check_nonnegative
from ragged_dtensor import RaggedShard

__all__ = ["AdamW8bit", "adamw8bit_block_policy"]

_CHUNK_CAP = 2**20  # elements: the scratch stays ~25 MiB however large the model
_SCRATCH_PER_ELEMENT = 25  # bytes of quant.Scratch per chunk element
_TARGET_TRANSIENT = 3  # bytes per stepped element (the bound is 4)


def adamw8bit_block_policy(
    block_size: int = 256, min_8bit_size: int = 4096
) -> AdamW8bitBlockPolicy:
    """A block policy keeping shards on quantization blocks (see ``AdamW8bitBlockPolicy``)."""
    return AdamW8bitBlockPolicy(block_size, min_8bit_size)


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
        self._places: dict[int, Place] = {}
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

    def _current_places(self) -> dict[int, Place]:
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
    ) -> dict[int, Place]:
        layouts = [(p, self._layout(p, name)) for _, name, p in everything]
        return make_places(layouts, self.block_size, self.min_8bit_size)

    def _views(self, place: Place, numel: int | None = None) -> dict[str, torch.Tensor]:
        return views(self._buffers, self._places, place, self.block_size, numel)

    def _init_state(self, item: Item, place: Place) -> dict[str, Any]:
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

    # -- the step ----------------------------------------------------------------------------
    def _runs(self, items: list[Item], places: list[Place]) -> list[Run]:
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
        params = [(name, p, self._layout(p, name)) for _, name, p in self._all_params()]
        by_group = plan_boundaries(params, self.block_size, self.min_8bit_size)
        self._boundaries = by_group
        self._exchanged = {param for members in by_group.values() for param, _, _ in members}

    def _step(self) -> None:
        all_places = self._current_places()
        items: list[Item] = []
        for group, name, param in self._params_with_grads():
            layout = self._layout(param, name)
            assert param.grad is not None
            if param.grad.shape != param.shape:
                raise ValueError(
                    f"parameter {name!r}: gradient shape {tuple(param.grad.shape)} "
                    f"differs from the parameter's {tuple(param.shape)}"
                )
            eight_bit = layout.numel >= self.min_8bit_size
            items.append(Item(param, name, group, layout, eight_bit, param in self._exchanged))
            for t in (param, param.grad):  # checked like local_flat, without making a view
                if not local_of(t).is_contiguous():
                    local_flat(t, name)
        places = [all_places[id(item.param)] for item in items]
        states = [self._init_state(item, place) for item, place in zip(items, places, strict=True)]
        for item, state in zip(items, states, strict=True):
            self._steps_done(item.param, state)  # read once after a load, before _runs
        edges = exchange_boundaries(
            self._boundaries, items, states, self.block_size, self._presence
        )
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
            first = items[run.members[0]].param
            chunks += update_run(
                run,
                items,
                places,
                states,
                edges,
                chunk,
                scratch,
                self._step_counts[first],
                self._views,
                block,
            )
        self._count_steps([(item.param, state) for item, state in zip(items, states, strict=True)])
        self.last_step_stats = {
            "runs": len(runs),
            "chunks": chunks,
            "scratch_elements": scratch.capacity if scratch is not None else 0,
        }
