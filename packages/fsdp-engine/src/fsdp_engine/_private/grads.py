"""A group's sharded gradients: one storage whose views are the sharded parameters' ``.grad``.

[Note: gradient storage lifetimes]
Unsharded gradients (compute dtype) live only while a backward hands them over to their
reduction. Sharded gradients (parameter dtype) live exactly as long as a ``.grad`` viewing them:
the engine keeps no strong reference to their storage after a reduction, so when the last
``.grad`` of a group is dropped (``zero_grad(set_to_none=True)``) its memory is freed at once,
like FSDP2's plain gradient tensors, and between steps no gradient memory is held. Each ``.grad``
holds its own elements' memory (its local tensor is over storage of its own, cut from the
group's: [Note: DTensors over views] in compat), and the storage's ``DBuffer`` object is kept
while any ``.grad`` DTensor the engine made lives: a ``_Keeper`` holds it and a weak reference
with a callback to each such ``.grad``; the last one to go drops it (nothing is attached to the
``.grad`` itself, so saving, pickling or copying a ``.grad`` carries none of it). The engine
references the buffer weakly. The next reduction then either
accumulates into the storage the ``.grad`` still view (in place, same objects: a ``.grad`` kept
with ``zero_grad(set_to_none=False)`` or through accumulation steps), or, when no ``.grad`` is
left, makes a fresh storage and fresh views (one buffer and one DTensor per trainable parameter,
as FSDP2 makes one DTensor per parameter per step).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from fsdp_engine._private import compat
from fsdp_engine._private.compact import Reduction, compact_buffer
from fsdp_engine._private.param import FSDPParam
from fsdp_engine._private.storage import ShardStorage, is_view_of

__all__ = ["ShardedGrads"]


class _Keeper:
    """A gradient storage's ``DBuffer``, held while any ``.grad`` DTensor made over it lives
    (module Note)."""

    __slots__ = ("buffer", "live", "refs")

    def __init__(self, buffer: DBuffer) -> None:
        self.buffer: DBuffer | None = buffer
        self.live = 0
        self.refs: list[weakref.ref[DTensor]] = []

    def watch(self, view: DTensor) -> None:
        self.live += 1
        self.refs.append(weakref.ref(view, self._dropped))

    def settle(self) -> None:
        """No ``.grad`` was made over the buffer: hold nothing (the caller's reference only)."""
        if self.live == 0:
            self.buffer = None
            self.refs = []

    def _dropped(self, _ref: weakref.ref[DTensor]) -> None:
        self.live -= 1
        if self.live == 0:
            self.buffer = None
            self.refs = []


class ShardedGrads:
    """The sharded gradient storage of a group for one reduction (full or compact) and each
    trainable parameter's ``.grad`` view of it (module Note)."""

    def __init__(self, storage: ShardStorage, params: Sequence[FSDPParam]) -> None:
        self.storage = storage
        self.params = params
        self._buffer: weakref.ref[DBuffer] | None = None
        self._keeper: _Keeper | None = None
        self._reduction: Reduction | None = None

    def forget(self) -> None:
        """A new layout (another mask or dtype): the next reduction makes a new storage."""
        self._buffer = None
        self._keeper = None
        self._reduction = None

    @property
    def buffer(self) -> DBuffer | None:
        """The storage the ``.grad`` view, while any does (None otherwise)."""
        return None if self._buffer is None else self._buffer()

    def target(self, reduction: Reduction) -> tuple[DBuffer, list[DTensor | None], bool]:
        """Where a reduction writes: the storage, each trainable parameter's ``.grad`` view
        (None for frozen ones; made now where a parameter has no ``.grad``), and whether it
        accumulates into ``.grad`` already there (which must be ours)."""
        existing = [p.sharded.grad for p in self.params]
        live = [g for g, t in zip(existing, reduction.mask, strict=True) if t and g is not None]
        buffer = self.buffer if reduction is self._reduction else None
        fresh = [None] * len(existing)
        if not live:
            buffer = self._new_buffer(reduction)
            return buffer, self._views(buffer, reduction, fresh, accumulating=False), False
        if buffer is None:  # .grad of another storage (a new mask, or set by hand): copied over
            buffer = self._new_buffer(reduction)
            self.adopt_into(buffer, reduction, existing)
            return buffer, self._views(buffer, reduction, fresh, accumulating=False), True
        return buffer, self._views(buffer, reduction, existing, accumulating=True), True

    def _new_buffer(self, reduction: Reduction) -> DBuffer:
        storage = self.storage
        if reduction.kind == "compact":
            buffer = compact_buffer(storage, reduction.segment, storage.dtype, zero=False)
        else:  # not zeroed: the reduction writes every element, or adopt_into does
            buffer = storage.buffer.new_like(storage.dtype, zero=False)
        self._buffer = weakref.ref(buffer)
        self._keeper = _Keeper(buffer)
        self._reduction = reduction
        return buffer

    def _locals(self, buffer: DBuffer, reduction: Reduction) -> list[torch.Tensor | None]:
        """Each trainable parameter's share of ``buffer`` (None for frozen ones)."""
        storage = self.storage
        out: list[torch.Tensor | None] = [None] * len(self.params)
        if reduction.kind == "compact":
            for i, _start, length, dst in reduction.pieces[storage.rank]:
                out[i] = buffer.shard[dst : dst + length]
            return out
        for i, (local, trainable) in enumerate(
            zip(storage.local_views(buffer), reduction.mask, strict=True)
        ):
            if trainable:
                out[i] = local
        return out

    def _views(
        self,
        buffer: DBuffer,
        reduction: Reduction,
        existing: Sequence[torch.Tensor | None],
        *,
        accumulating: bool,
    ) -> list[DTensor | None]:
        views: list[DTensor | None] = [None] * len(self.params)
        for i, local in enumerate(self._locals(buffer, reduction)):
            if local is None:
                continue
            grad = existing[i]
            if isinstance(grad, DTensor) and is_view_of(grad, local):
                views[i] = grad  # accumulate into the .grad the user holds
                continue
            if grad is not None:
                raise RuntimeError(
                    f"parameter {self.params[i].fqn!r}: .grad was replaced by a tensor that is "
                    "not the engine's gradient storage; use zero_grad() or accumulate into it "
                    "in place"
                )
            if accumulating:
                local.zero_()  # a parameter whose .grad alone was dropped
            view = self.storage.grad_dtensor(i, local, self.params[i].dtensor)
            keeper = self._keeper
            if keeper is not None and keeper.buffer is buffer:
                keeper.watch(view)
            views[i] = view
        if self._keeper is not None:
            self._keeper.settle()
        return views

    def adopt_into(
        self, buffer: DBuffer, reduction: Reduction, grads: Sequence[torch.Tensor | None]
    ) -> None:
        """Copy gradients made elsewhere into ``buffer`` (zeros where there are none)."""
        for grad, local in zip(grads, self._locals(buffer, reduction), strict=True):
            if local is None:
                continue
            with torch.no_grad():
                if grad is None:
                    local.zero_()
                else:
                    src = compat.local_tensor(grad) if isinstance(grad, DTensor) else grad
                    local.copy_(src.reshape(local.shape))

    def adopt(self, reduction: Reduction, grads: Sequence[torch.Tensor | None]) -> None:
        """Gradients made elsewhere (``_apply`` converted them, or a new mask re-laid the
        storage) become ours: copied into a new storage whose views are the ``.grad``."""
        if not any(g is not None for g, t in zip(grads, reduction.mask, strict=True) if t):
            for param, grad in zip(self.params, grads, strict=True):
                param.sharded.grad = grad
            return
        buffer = self._new_buffer(reduction)
        self.adopt_into(buffer, reduction, grads)
        views = self._views(buffer, reduction, [None] * len(grads), accumulating=False)
        for param, grad, view in zip(self.params, grads, views, strict=True):
            param.sharded.grad = view if view is not None else grad
