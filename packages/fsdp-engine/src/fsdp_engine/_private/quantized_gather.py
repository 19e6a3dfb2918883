"""Quantized weight communication: the policy, the tile-aligned block policy, the packed unshard.

[Note: quantized all-gather of a group]
With ``MixedPrecisionPolicy(quantized_all_gather=QuantizedAllGather(...))`` a group's unshard is
one all-gather of bytes ([Note: the packed byte layout] in dbuffer): each rank's section holds,
for every tensor piece in its shard in buffer order, the blockwise codes of the quantized
weights (one byte per element) or the compute-dtype values of the others (norms, biases, small
tensors), then the fp32 scales of its quantized blocks. Each rank quantizes its own shard of the
fp32 master weights; on arrival every piece is dequantized (or copied) into the compute-dtype
unsharded storage, whose views are the parameters forward and backward use, exactly as after a
plain all-gather. Nothing else changes: gradients flow to those parameters (the quantization is
a straight-through estimator) and are reduce-scattered in ``reduce_dtype`` into the sharded
gradients; the master weights, the optimizer and checkpoints never see a code.

Exactness follows from [Note: a shard quantizes exactly its own tiles]: the block policy
(``TileAlignedBlocks``) asks the planner for blocks of whole block rows, so every share starts and
ends between block rows, and the dequantized unsharded weights equal quantize-then-dequantize of
the full tensors bit for bit. ``QuantizedGather`` re-checks that on the layout it is given and
refuses, by name, a parameter whose blocks a shard boundary would cut.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Protocol

import attrs
import torch
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, Handle, PackedAllGather, PackedLayout, packed_layout
from fsdp_engine._private.api import (
    QUANTIZABLE,
    QuantizedAllGather,
    QuantizedWeight,
    callable_repr,
)
from fsdp_engine._private.quantize import (
    code_dtype,
    dequantize_panels,
    panel_block_elements,
    panel_shape,
    quantize_panels,
    scale_grid,
)

__all__ = [
    "QuantizedGather",
    "TileAlignedBlocks",
    "quantized_gather",
    "select_quantized",
]


def select_quantized(
    policy: QuantizedAllGather | None, names: Sequence[str], params: Sequence[torch.Tensor]
) -> tuple[bool, ...]:
    """Which of a group's parameters the policy quantizes; refuses, by name, a chosen one the
    quantized all-gather cannot carry."""
    if policy is None:
        return (False,) * len(params)
    chosen = []
    for name, param in zip(names, params, strict=True):
        if not policy.selects(name, param):
            chosen.append(False)
            continue
        if isinstance(param, DTensor):
            raise NotImplementedError(
                f"fully_shard: parameter {name!r} is a DTensor on {param.device_mesh} "
                f"({param.placements}); the quantized all-gather does not quantize "
                f"tensor-parallel shards yet: leave it out with QuantizedAllGather(filter=...)"
            )
        if param.dtype not in QUANTIZABLE or param.numel() == 0:
            raise ValueError(
                f"fully_shard: the quantized all-gather chose parameter {name!r} ({param.dtype}, "
                f"shape {tuple(param.shape)}); it quantizes non-empty floating weights of "
                f"{[str(d) for d in QUANTIZABLE]}"
            )
        rows = panel_shape(tuple(param.shape), policy.block)[0]
        br, bc = policy.block
        if rows % br:
            raise ValueError(
                f"fully_shard: the quantized all-gather chose parameter {name!r} (shape "
                f"{tuple(param.shape)}), whose {rows} rows are not a multiple of its {br}x{bc} "
                f"blocks' {br}: a shard boundary would cut its last, partial row of blocks (the "
                f"planner's blocks are uniform; only keeping the whole weight on one rank would "
                f"avoid it). Leave it out of QuantizedAllGather(filter=...), as the default "
                f"rule does, or use (1, {bc}) row blocks"
            )
        chosen.append(True)
    return tuple(chosen)


class _BlockPolicy(Protocol):
    def __call__(self, name: str, param: torch.Tensor) -> int: ...


@attrs.frozen
class TileAlignedBlocks:
    """The block policy that makes every shard boundary fall between block rows of the quantized
    weights: for those, the least common multiple of one block row (``panel_block_elements``) and
    the ``base`` policy's block (an optimizer's quantization block, say: both stay whole); for the
    others the ``base`` block (1 without one)."""

    policy: QuantizedAllGather
    selected: frozenset[str]
    base: _BlockPolicy | None = attrs.field(default=None, repr=callable_repr)

    def __call__(self, name: str, param: torch.Tensor) -> int:
        value = 1 if self.base is None else self.base(name, param)
        if name not in self.selected:
            return value
        numel = param.numel()
        try:
            base = operator.index(value)
        except TypeError:
            return value  # not a valid block: the caller's check names the base policy
        if isinstance(value, bool) or base < 1 or numel % base:
            return value
        # Both divide numel, so their lcm does: boundaries every lcm elements keep both whole.
        return math.lcm(base, panel_block_elements(tuple(param.shape), self.policy.block))


@attrs.frozen
class _Piece:
    """Tensor ``index``'s elements ``[start, stop)`` in rank ``rank``'s shard, and where they
    travel: segment ``data`` (codes, or compute-dtype values) and ``scales`` (-1: none)."""

    rank: int
    index: int
    start: int
    stop: int
    data: int
    scales: int


class QuantizedGather:
    """One packed all-gather of a group's codes, scales and unquantized values
    ([Note: quantized all-gather of a group])."""

    def __init__(
        self, policy: QuantizedAllGather, params: DBuffer, selected: Sequence[bool]
    ) -> None:
        self.policy = policy
        self.buffer = params  # the layout's geometry (a re-typed buffer has the same slots)
        self.selected = tuple(selected)
        self.code_dtype = code_dtype(policy.format)
        self.panels = [panel_shape(tuple(s.shape), policy.block) for s in params.slots]
        self.pieces = self._pieces()
        self._gathers: dict[torch.dtype, PackedAllGather] = {}

    def _pieces(self) -> list[list[_Piece]]:
        """Every rank's pieces in buffer order, checking that no share cuts a block row."""
        buffer = self.buffer
        size, world = buffer.shard_size, buffer.world_size
        ranks: list[list[tuple[int, int, int]]] = [[] for _ in range(world)]
        for slot in sorted(buffer.slots, key=lambda s: s.offset):
            if slot.numel == 0:
                continue
            stop = slot.offset + slot.numel
            for k in range(slot.offset // size, (stop - 1) // size + 1):
                lo, hi = max(slot.offset, k * size), min(stop, (k + 1) * size)
                ranks[k].append((slot.index, lo - slot.offset, hi - slot.offset))
        out: list[list[_Piece]] = []
        for k, spans in enumerate(ranks):
            # segments: one per piece (codes or values), then one per quantized piece (scales)
            scale = len(spans)
            pieces = []
            for data, (i, lo, hi) in enumerate(spans):
                if self.selected[i]:
                    self._check_rows(i, k, lo, hi)
                    pieces.append(_Piece(k, i, lo, hi, data, scale))
                    scale += 1
                else:
                    pieces.append(_Piece(k, i, lo, hi, data, -1))
            out.append(pieces)
        return out

    def _check_rows(self, i: int, rank: int, lo: int, hi: int) -> None:
        slot = self.buffer.slots[i]
        width = self.panels[i][1]
        row_block = self.policy.block[0] * width
        for edge in (lo, hi):
            if edge % row_block and edge != slot.numel:
                br, bc = self.policy.block
                raise ValueError(
                    f"fully_shard: the layout cuts a {br}x{bc} quantization block of parameter "
                    f"{slot.name!r} (shape {slot.shape}): rank {rank} holds its elements "
                    f"[{lo}, {hi}), but its shares must start and end at multiples of {row_block} "
                    f"elements (whole block rows); use the engine's block policy"
                )

    def _rows(self, piece: _Piece) -> tuple[int, int]:
        """The piece's panel rows and its scale rows."""
        width = self.panels[piece.index][1]
        rows = (piece.stop - piece.start) // width
        return rows, -(-rows // self.policy.block[0])

    def _sizes(self, dtype: torch.dtype) -> list[list[int]]:
        itemsize = torch.empty((), dtype=dtype).element_size()
        sizes = []
        for pieces in self.pieces:
            data = []
            scales = []
            for p in pieces:
                numel = p.stop - p.start
                if p.scales < 0:
                    data.append(numel * itemsize)
                    continue
                data.append(numel)  # one byte per code
                tc = scale_grid(1, self.panels[p.index][1], self.policy.block)[1]
                scales.append(self._rows(p)[1] * tc * 4)
            sizes.append(data + scales)
        return sizes

    def layout(self, dtype: torch.dtype) -> PackedLayout:
        """The packed layout for the compute dtype ``dtype``."""
        return self._gather(dtype).layout

    def _gather(self, dtype: torch.dtype) -> PackedAllGather:
        gather = self._gathers.get(dtype)
        if gather is None:
            # compared across ranks once (the first dtype); later dtypes follow from the same
            # agreed plan and choice
            gather = PackedAllGather(
                self.buffer, packed_layout(self._sizes(dtype)), check=not self._gathers
            )
            self._gathers[dtype] = gather
        return gather

    def unshard(
        self,
        params: DBuffer,
        *,
        dtype: torch.dtype,
        async_op: bool,
        ready: torch.Event | None = None,
    ) -> Handle:
        """Fill ``params``' unsharded storage of ``dtype`` (the compute dtype): quantize this
        rank's shard, one packed all-gather, dequantize every piece."""
        gather = self._gather(dtype)
        if gather.buffer is not params:  # the group's buffer was re-typed (``module.to``)
            gather = self._gathers[dtype] = PackedAllGather(params, gather.layout, check=False)
        layout = gather.layout
        hook = self.policy.hook
        return gather.unshard(
            lambda send: self._encode(params, layout, send, dtype),
            lambda recv, out: self._decode(layout, recv, out),
            dtype=dtype,
            async_op=async_op,
            ready=ready,
            after=None if hook is None else lambda recv: self._call_hook(hook, layout, recv),
        )

    def _call_hook(
        self, hook: Callable[[QuantizedWeight], None], layout: PackedLayout, recv: torch.Tensor
    ) -> None:
        for weight in self.gathered(layout, recv):
            hook(weight)

    def _encode(
        self, params: DBuffer, layout: PackedLayout, send: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """This rank's section: its shares quantized (codes, scales) or cast to ``dtype``; all
        pieces at once ([Note: the pieces of a group at once] in ``quantize``)."""
        rank = params.rank
        locals_ = params.local_views()
        panels, codes, scales = [], [], []
        plain: list[torch.Tensor] = []
        segments: list[torch.Tensor] = []
        for p in self.pieces[rank]:
            share = locals_[p.index]
            if p.scales < 0:
                plain.append(share.reshape(-1))
                segments.append(layout.segment(send, rank, p.data, dtype, gathered=False))
                continue
            rows, scale_rows = self._rows(p)
            width = self.panels[p.index][1]
            panels.append(share.view(rows, width))
            code = layout.segment(send, rank, p.data, self.code_dtype, gathered=False)
            codes.append(code.view(rows, width))
            scale = layout.segment(send, rank, p.scales, torch.float32, gathered=False)
            scales.append(scale.view(scale_rows, -1))
        if plain:  # one cast of every unquantized share, one foreach copy into the segments
            cast = torch.cat(plain).to(dtype)
            torch._foreach_copy_(segments, list(torch.split(cast, [t.numel() for t in plain])))
        if panels:
            quantize_panels(panels, self.policy.block, self.policy.format, codes, scales)

    def _decode(self, layout: PackedLayout, recv: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's pieces into the unsharded flat tensor ``out``: dequantized or copied,
        all at once ([Note: the pieces of a group at once] in ``quantize``)."""
        slots = self.buffer.slots
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        codes, scales, panels = [], [], []
        for pieces in self.pieces:
            for p in pieces:
                base = slots[p.index].offset
                target = out[base + p.start : base + p.stop]
                if p.scales < 0:
                    targets.append(target)
                    sources.append(layout.segment(recv, p.rank, p.data, out.dtype))
                    continue
                rows, scale_rows = self._rows(p)
                width = self.panels[p.index][1]
                code = layout.segment(recv, p.rank, p.data, self.code_dtype)
                codes.append(code.view(rows, width))
                scale = layout.segment(recv, p.rank, p.scales, torch.float32)
                scales.append(scale.view(scale_rows, -1))
                panels.append(target.view(rows, width))
        if targets:
            torch._foreach_copy_(targets, sources)
        if codes:
            dequantize_panels(codes, scales, self.policy.block, panels)

    def gathered(self, layout: PackedLayout, recv: torch.Tensor) -> list[QuantizedWeight]:
        """Each quantized weight's codes and scales, assembled from every rank's pieces."""
        codes: dict[int, list[torch.Tensor]] = {}
        scales: dict[int, list[torch.Tensor]] = {}
        for pieces in self.pieces:
            for p in pieces:
                if p.scales >= 0:
                    codes.setdefault(p.index, []).append(
                        layout.segment(recv, p.rank, p.data, self.code_dtype)
                    )
                    scales.setdefault(p.index, []).append(
                        layout.segment(recv, p.rank, p.scales, torch.float32)
                    )
        out = []
        block = self.policy.block
        for i in sorted(codes):
            slot = self.buffer.slots[i]
            shape = slot.shape
            rows = math.prod(shape[:-1]) if shape else 1
            grid = scale_grid(rows, shape[-1] if shape else 1, block)
            out.append(
                QuantizedWeight(
                    slot.name,
                    torch.cat(codes[i]).view(shape),
                    torch.cat(scales[i]).view(grid),
                    self.policy.format,
                    block,
                )
            )
        return out


def quantized_gather(
    policy: QuantizedAllGather | None, params: DBuffer, selected: Sequence[bool]
) -> QuantizedGather | None:
    """The group's quantized all-gather, or None (the plain all-gather) when there is no policy
    or it chose none of the group's weights.

    With a policy, every rank compares the byte layout its choice implies (a collective at
    ``fully_shard``), chosen weights or not: a rank-dependent ``filter`` raises
    ``LayoutMismatchError`` on every rank instead of leaving ranks in different collectives.
    """
    if policy is None:
        return None
    quantized = QuantizedGather(policy, params, selected)
    quantized.layout(torch.float32)  # the agreement check (any dtype encodes the choice)
    return quantized if any(selected) else None
