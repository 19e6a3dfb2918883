"""Where ``AdamW8bit``'s state lives: one flat buffer per storage and state key, a place per
parameter (its slot, state kind and offsets), made once per layout (``adamw8bit``'s runs note)."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from optim_blockwise._private import quant
from optim_blockwise._private.layout import ParamLayout
from optim_blockwise._private.runs import Slot, compact, slot_of

__all__ = ["EIGHT_BIT_KEYS", "FP32_KEYS", "Item", "Place", "buffer", "make_places", "views"]

EIGHT_BIT_KEYS = ("exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes", "exp_avg_sq_absmax")
FP32_KEYS = ("exp_avg", "exp_avg_sq")


@attrs.frozen(eq=False)
class Item:
    """One parameter's view for one step."""

    param: torch.Tensor
    name: str
    group: dict[str, Any]
    layout: ParamLayout
    eight_bit: bool
    exchange: bool
    """Its shards cut quantization blocks: boundary absmaxes are exchanged."""


@attrs.frozen(eq=False)
class Place:
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


def make_places(
    layouts: list[tuple[torch.Tensor, ParamLayout]], block: int, min_8bit_size: int
) -> dict[int, Place]:
    """Every parameter's place (by ``id``): 8-bit and fp32 state compacted per storage."""
    slots, kinds, heads, blocks = [], [], [], []
    for p, layout in layouts:
        n = layout.local_numel
        eight = layout.numel >= min_8bit_size
        head = layout.start % block if eight else 0
        slots.append(slot_of(p))
        kinds.append(eight)
        heads.append(head)
        blocks.append(-(-(head + n) // block) if (eight and n) else 0)
    places: dict[int, Place] = {}
    for eight in (True, False):
        # 8-bit and fp32 state live in separate buffers: compact each kind on its own
        chosen = [i for i, k in enumerate(kinds) if k == eight]
        sub = [slots[i] for i in chosen]
        offsets = compact(sub)
        block_offsets = compact(sub, [blocks[i] for i in chosen])
        for j, i in enumerate(chosen):
            places[id(layouts[i][0])] = Place(
                slots[i], eight, heads[i], blocks[i], offsets[j], block_offsets[j]
            )
    return places


def buffer(
    buffers: dict[tuple[object, str], torch.Tensor],
    places: dict[int, Place],
    place: Place,
    key: str,
    length: int,
) -> torch.Tensor:
    """The flat ``key`` state buffer of ``place``'s storage (made on first use)."""
    bkey = (place.slot.storage, key)
    buf = buffers.get(bkey)
    if buf is None:
        per_block = key.endswith("_absmax")
        sizes = [
            (q.block_offset + q.blocks) if per_block else (q.offset + q.slot.numel)
            for q in places.values()
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
        buffers[bkey] = buf
    assert buf.numel() >= length
    return buf


def views(
    buffers: dict[tuple[object, str], torch.Tensor],
    places: dict[int, Place],
    place: Place,
    block: int,
    numel: int | None = None,
) -> dict[str, torch.Tensor]:
    """Flat state slices from ``place``: its own, or with ``numel`` those of a run of
    ``numel`` elements that starts there (absmaxes: the blocks the elements touch)."""
    if numel is None:
        numel, blocks = place.slot.numel, place.blocks
    else:
        blocks = -(-(place.head + numel) // block)
    out = {}
    for key in EIGHT_BIT_KEYS if place.eight_bit else FP32_KEYS:
        lo, n = (place.block_offset, blocks) if key.endswith("_absmax") else (place.offset, numel)
        out[key] = buffer(buffers, places, place, key, lo + n)[lo : lo + n]
    return out
