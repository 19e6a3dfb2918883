"""Who else holds a storage: the check that lets a buffer reuse its memory in place.

[Note: releasing a storage that views were handed out from]
A buffer that frees its shard storage between steps (sharded gradients after
``zero_grad(set_to_none=True)``) can keep the storage *object* and every view made of it, and
re-allocate in place next step, instead of building a new buffer and new DTensors each step --
but only if nobody outside still holds one of those views: freeing memory under a tensor a user
kept (``g = p.grad`` before ``zero_grad``) would make it read freed memory. Two counts together
see every way to hold it:

- a new tensor over the storage (``g.to_local().view(...)``, a slice, ``detach()``) adds one to
  the storage's use count (each tensor holds a reference to its storage);
- keeping one of the buffer's own tensor objects (``g = p.grad``) adds one to that Python
  object's reference count.

``Claim`` records both when the buffer's own views are complete and nothing was handed out yet;
``Claim.unchanged()`` later says whether anything besides those own references exists. If it does,
the buffer is left to whoever holds it (and garbage-collected with the last reference) and a new
one is made, exactly what happens without reuse.

The storage use count comes from ``torch._C._storage_Use_Count``, which torch's own inductor uses
for the same question (``cudagraph_trees``); without it every check answers "held elsewhere", so
nothing is ever reused in place -- slower, never wrong.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

__all__ = ["Claim", "storage_use_count"]


def storage_use_count(tensor: torch.Tensor) -> int | None:
    """How many references ``tensor``'s storage has (tensors and storage handles), or None if
    this torch cannot say."""
    counter = getattr(torch._C, "_storage_Use_Count", None)
    if counter is None:  # pragma: no cover - present in torch 2.13 (tests check it)
        return None
    return int(counter(tensor.untyped_storage()._cdata))


class Claim:
    """The references to one storage and to a set of tensor objects over it.

    ``mark()`` records the counts (call it with no tensor in the calling frames but the owner's
    own: arguments being passed, e.g. to this constructor, hold references of their own);
    ``unchanged()`` compares against them.
    """

    def __init__(self, storage_of: torch.Tensor, objects: Sequence[torch.Tensor]) -> None:
        self._storage_of = storage_of
        self._objects = tuple(objects)
        self._storage_count: int | None = None
        self._counts: tuple[int, ...] | None = None

    def _object_counts(self) -> tuple[int, ...]:
        # Called from mark() and unchanged() alike, so the references this code itself holds
        # (the tuple, the loop variable, getrefcount's argument) are the same both times.
        return tuple(sys.getrefcount(obj) for obj in self._objects)

    def mark(self) -> None:
        self._storage_count = storage_use_count(self._storage_of)
        self._counts = self._object_counts()

    def unchanged(self) -> bool:
        """True when no reference to the storage or to the claimed objects was added since
        ``mark()`` (False if it was never marked, or this torch cannot count)."""
        if self._storage_count is None or self._counts is None:
            return False
        if storage_use_count(self._storage_of) != self._storage_count:
            return False
        return self._object_counts() == self._counts
