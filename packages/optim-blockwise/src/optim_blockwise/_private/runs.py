"""Runs: consecutive parameters that are views of one storage, stepped as one flat tensor.

[Note: runs]
A sharding engine with flat buffers (fsdp-engine) makes every parameter's local shard a view of
one storage per group, and every gradient a view of one gradient storage at the same relative
offsets. An elementwise (or blockwise) update of such parameters can run on the concatenation
directly: one flat view of the parameters, one of the gradients, one of each state buffer, a
constant number of kernels for the whole run instead of per parameter. Nothing is assumed about
the engine: adjacency is read from the tensors (storage, offset, contiguity), and anything else
(plain parameters, gradients set by hand) falls back to runs of one.

The optimizer's state then lives in one flat buffer per storage (``CompactLayout``: parameters
sorted by offset, gaps dropped), so a run's state is one slice too; ``state[p]`` holds views.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import torch
from torch.distributed.tensor import DTensor

__all__ = ["Slot", "slot_of", "local_of", "follows", "grads_follow", "flat_view", "compact"]

StorageKey = tuple[int, torch.dtype, torch.device]


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@attrs.frozen
class Slot:
    """Where one parameter's local data lies: its storage, element offset, numel."""

    storage: StorageKey
    offset: int
    numel: int
    contiguous: bool


def slot_of(param: torch.Tensor) -> Slot:
    local = local_of(param)
    key = (local.untyped_storage().data_ptr(), local.dtype, local.device)
    return Slot(key, int(local.storage_offset()), local.numel(), local.is_contiguous())


def follows(prev: Slot, nxt: Slot) -> bool:
    """``nxt``'s data starts where ``prev``'s ends, in the same storage."""
    return (
        prev.storage == nxt.storage
        and prev.contiguous
        and nxt.contiguous
        and nxt.offset == prev.offset + prev.numel
    )


def grads_follow(prev: torch.Tensor, nxt: torch.Tensor, prev_numel: int) -> bool:
    """Local gradient ``nxt`` starts where ``prev`` (``prev_numel`` elements) ends, in one
    storage (so one flat view spans both)."""
    return (
        nxt.is_contiguous()
        and prev.is_contiguous()
        and nxt.dtype == prev.dtype
        and nxt.data_ptr() == prev.data_ptr() + prev_numel * nxt.element_size()
        and nxt.untyped_storage().data_ptr() == prev.untyped_storage().data_ptr()
    )


def flat_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of ``first``'s storage from ``first``'s start: a view of its base, so
    in-place updates bump the version counter autograd checks."""
    return first.as_strided((numel,), (1,), first.storage_offset())


def compact(slots: Sequence[Slot], sizes: Iterable[int] | None = None) -> list[int]:
    """Offsets of each slot in a compact buffer of its storage (slots sorted by offset, gaps
    dropped). ``sizes[i]`` (default: numel) is what slot ``i`` takes in the buffer (e.g. its
    number of quantization blocks)."""
    length = list(sizes) if sizes is not None else [s.numel for s in slots]
    offsets = [0] * len(slots)
    totals: dict[StorageKey, int] = {}
    for i in sorted(range(len(slots)), key=lambda j: (slots[j].storage[0], slots[j].offset, j)):
        key = slots[i].storage
        offsets[i] = totals.get(key, 0)
        totals[key] = offsets[i] + length[i]
    return offsets
