"""Checking tensors against a buffer's layout before they are loaded into it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from dbuffer._private.buffer import DBuffer

__all__ = ["check_tensors"]


def check_tensors(
    buffer: DBuffer, tensors: Sequence[torch.Tensor], *, full: bool = True, what: str = "tensor"
) -> None:
    """Raise ``ValueError`` naming the first tensor whose numel, dtype or device does not
    match ``buffer``'s layout (``full``: whole tensors; else this rank's local shares)."""
    if len(tensors) != len(buffer.slots):
        raise ValueError(f"DBuffer: got {len(tensors)} {what}s for {len(buffer.slots)} slots")
    for slot, tensor in zip(buffer.slots, tensors, strict=True):
        expected = slot.numel if full else slot.local_numel
        where = f"{what} {slot.name!r} (index {slot.index})"
        if tensor.numel() != expected:
            raise ValueError(
                f"{where}: has {tensor.numel()} elements (shape "
                f"{tuple(tensor.shape)}), the layout expects {expected}"
                f"{'' if full else ' on rank ' + str(buffer.rank)}"
            )
        if tensor.dtype != buffer.dtype:
            raise ValueError(f"{where}: dtype {tensor.dtype}, the buffer holds {buffer.dtype}")
        if tensor.device != buffer.device:
            raise ValueError(
                f"{where}: on device {tensor.device}, the buffer lives on {buffer.device}"
            )
