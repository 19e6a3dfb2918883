"""A group's sharded gradients: one storage whose views are the sharded parameters' ``.grad``.

[Note: gradient storage lifetimes]
Unsharded gradients (compute dtype) live only from pre-backward to their reduction. Sharded
gradients (parameter dtype) live from the first reduction until every sharded parameter's
``.grad`` was dropped (``zero_grad(set_to_none=True)``): then the buffer is let go and a fresh
one is made by the next reduction, so between steps and through forward and backward no
gradient memory is held, like FSDP2. The buffer object and its views are kept and only their
memory is released and re-allocated, when nothing outside the engine holds one of them
(``dbuffer``'s [Note: releasing a storage that views were handed out from]); views a user still
holds keep their (refcounted) storage alive, nothing is freed under them, and a new buffer is
made instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from fsdp_engine._private import compat
from fsdp_engine._private.compact import Reduction, compact_buffer
from fsdp_engine._private.param import FSDPParam
from fsdp_engine._private.storage import ShardStorage, is_view_of

__all__ = ["ShardedGrads"]


class ShardedGrads:
    """The sharded gradient storage of a group, laid out for one reduction (full or compact),
    and each trainable parameter's ``.grad`` view of it."""

    def __init__(self, storage: ShardStorage, params: Sequence[FSDPParam]) -> None:
        self.storage = storage
        self.params = params
        self.buffer: DBuffer | None = None
        self._views: list[DTensor | None] | None = None

    def forget(self) -> None:
        """A new layout (another mask): the next reduction makes a new buffer."""
        self.buffer = None
        self._views = None

    def views(self, reduction: Reduction) -> list[DTensor | None]:
        """Each trainable parameter's sharded gradient (a DTensor view of the storage, made
        with the storage, memory given back if it was released); None for frozen ones."""
        if self.buffer is None or self._views is None:
            buffer, views = self._new_views(reduction)
            self.buffer, self._views = buffer, views
            # What the engine itself keeps over the storage; a generator, so that no container
            # of this frame holds the tensors while the claim counts them (nor may a loop
            # variable: the views are made in their own frame)
            buffer.claim_views(
                t for v in views if v is not None for t in (v, compat.local_tensor(v))
            )
        self.buffer.alloc_shard()  # memory again after release_dropped (same views)
        return self._views

    def _new_views(self, reduction: Reduction) -> tuple[DBuffer, list[DTensor | None]]:
        storage = self.storage
        views: list[DTensor | None] = [None] * len(self.params)
        if reduction.kind == "compact":
            buffer = compact_buffer(storage, reduction.segment, storage.dtype)
            for i, _start, length, dst in reduction.pieces[storage.rank]:
                like = self.params[i].dtensor
                views[i] = storage.grad_dtensor(i, buffer.shard[dst : dst + length], like)
            return buffer, views
        buffer = storage.buffer.new_like(storage.dtype)
        for i, (local, trainable) in enumerate(
            zip(storage.local_views(buffer), reduction.mask, strict=True)
        ):
            if trainable:
                views[i] = storage.grad_dtensor(i, local, self.params[i].dtensor)
        return buffer, views

    def prepare_accumulation(self, views: Sequence[DTensor | None]) -> bool:
        """Before a reduction into the storage: whether it accumulates (some trainable
        parameter already has a ``.grad``, which must be ours); a view without one is zeroed."""
        existing = [p.sharded.grad for p in self.params]
        accumulate = any(
            g is not None for g, v in zip(existing, views, strict=True) if v is not None
        )
        if not accumulate:
            return False
        for param, grad, view in zip(self.params, existing, views, strict=True):
            if view is None:
                continue
            local = compat.local_tensor(view)
            if grad is None:
                local.zero_()
            elif not is_view_of(grad, local):
                raise RuntimeError(
                    f"parameter {param.fqn!r}: .grad was replaced by a tensor that is not the "
                    "engine's gradient storage; use zero_grad() or accumulate into it in place"
                )
        return True

    def adopt(self, reduction: Reduction, grads: Sequence[torch.Tensor | None]) -> None:
        """Gradients made elsewhere (``_apply`` converted them, or a new mask re-laid the
        storage): copy them into our storage and make our views the ``.grad``."""
        views = self.views(reduction)
        for param, grad, view in zip(self.params, grads, views, strict=True):
            if grad is None or view is None:
                param.sharded.grad = grad
                continue
            local = compat.local_tensor(grad) if isinstance(grad, DTensor) else grad
            target = compat.local_tensor(view)
            with torch.no_grad():
                target.copy_(local.reshape(target.shape))
            param.sharded.grad = view

    def release_dropped(self) -> None:
        """Let the memory go once no parameter's ``.grad`` refers to it (module Note)."""
        if self.buffer is None:
            return
        if all(p.sharded.grad is None for p in self.params) and not self.buffer.release_shard():
            self.forget()  # a view is still held (a user kept ``p.grad``): it keeps its storage
