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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.autograd.grad_mode import _unsafe_preserve_version_counter

from dbuffer._private import storage

__all__ = ["Claim", "ReleasableShard", "storage_use_count"]


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


class ReleasableShard:
    """Mixed into ``DBuffer``: its shard storage freed and re-allocated in place between uses,
    only while nobody outside holds it (module Note)."""

    shard: torch.Tensor
    _local_views: tuple[torch.Tensor, ...]
    _sharded_views: tuple[torch.Tensor, ...] | None
    _claim: Claim | None

    if TYPE_CHECKING:

        def wait(self) -> None: ...  # the buffer's: collectives in flight

    def claim_views(self, extra: Iterable[torch.Tensor] = ()) -> None:
        """Record the references to the shard storage and to its views that exist now as this
        buffer's own: the shard, its local views, its sharded views if made, and ``extra``
        (tensors the caller built over the shard and keeps). Call once they are all made and
        none is handed out; ``release_shard`` then frees in place only while no other reference
        was added. ``extra`` is consumed here: pass a generator (or a temporary), not a list the
        caller keeps, so that the count holds only the references that last."""
        objects = (self.shard, *self._local_views, *(self._sharded_views or ()), *extra)
        del extra
        claim = Claim(self.shard, objects)
        del objects
        claim.mark()  # here, not in Claim(): the arguments of that call hold references
        self._claim = claim

    def _views_held_elsewhere(self) -> bool:
        """True if anything beyond the claimed references holds the shard storage or one of its
        views (a tensor a user kept), or if nothing was claimed."""
        return self._claim is None or not self._claim.unchanged()

    def release_shard(self) -> bool:
        """Free the shard storage in place, keeping the storage object and every view, if no
        reference beyond the claimed ones exists; True if freed. ``alloc_shard`` re-allocates:
        the same views then see the new memory (its values are undefined until written)."""
        if self._views_held_elsewhere():
            return False
        self.wait()
        storage.free_storage(self.shard)
        return True

    def alloc_shard(self, *, zero: bool = False) -> None:
        """Give the shard storage its memory back after ``release_shard`` (a no-op if it has
        it); ``zero`` fills it with zeros."""
        if storage.allocate_storage(self.shard) and zero:
            with _unsafe_preserve_version_counter(self.shard):
                self.shard.zero_()

    @property
    def shard_allocated(self) -> bool:
        return self.shard.untyped_storage().nbytes() != 0

    def _require_shard(self, op: str) -> None:
        if not self.shard_allocated:
            raise RuntimeError(
                f"DBuffer.{op}: the shard storage is released (call alloc_shard() first)"
            )
