"""What tests, examples and benchmarks do with a ``DBuffer`` that no package does: load full
tensors into it, see its shards as DTensors, make it the ``.grad`` of leaves, ask whether its
shard storage is held elsewhere. Public as ``dbuffer.testing`` (with the measurement modes)."""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from dbuffer._private.buffer import DBuffer
from dbuffer._private.loading import check_tensors

__all__ = ["attach_grads", "load_full_", "sharded_views", "views_held_elsewhere"]


@torch.no_grad()
def load_full_(buffer: DBuffer, tensors: Sequence[torch.Tensor]) -> DBuffer:
    """Copy this rank's share of each full tensor into ``buffer``'s shard (initialisation);
    returns ``buffer``. A tensor whose numel, dtype or device does not match the layout raises
    ``ValueError`` naming it."""
    check_tensors(buffer, tensors, full=True)
    buffer.wait()
    for slot, local, tensor in zip(buffer.slots, buffer.local_views(), tensors, strict=True):
        flat = tensor.reshape(-1)
        local.copy_(flat[slot.tensor_start : slot.tensor_start + slot.local_numel])
    return buffer


def sharded_views(buffer: DBuffer) -> tuple[DTensor, ...]:
    """Each tensor of ``buffer`` as a ``RaggedShard`` DTensor whose local tensor is a view of its
    shard (no copy). Made once per buffer; the same objects every call (and across
    ``release_shard``), and counted as the buffer's own by ``claim_views``."""
    if buffer._sharded_views is None:
        buffer._sharded_views = tuple(
            DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]
            for local, spec in zip(buffer.local_views(), buffer.specs(), strict=True)
        )
    return buffer._sharded_views


def attach_grads(buffer: DBuffer, params: Sequence[torch.Tensor]) -> None:
    """Make each ``params[i].grad`` the full view ``i`` of ``buffer`` (a gradient buffer), so
    autograd accumulates gradients in place into its unsharded storage. The storage must be
    allocated (``alloc_unsharded(zero=True)``). When it is released (``reshard`` or a
    ``reduce_scatter`` that frees it), those ``.grad`` are reset to None."""
    check_tensors(buffer, params, full=True, what="parameter")
    if not buffer.is_unsharded():
        raise RuntimeError("attach_grads: allocate the buffer's unsharded storage first")
    for param, view in zip(params, buffer.full_views(), strict=True):
        if tuple(param.shape) != tuple(view.shape):
            raise ValueError(
                f"parameter shape {tuple(param.shape)} differs from the "
                f"layout's {tuple(view.shape)}"
            )
        param.grad = view
        buffer._grad_owners.append((weakref.ref(param), view))


def views_held_elsewhere(buffer: DBuffer) -> bool:
    """True if anything beyond the references ``claim_views`` recorded holds ``buffer``'s shard
    storage or one of its views (then ``release_shard`` keeps it), or if nothing was claimed."""
    return buffer._views_held_elsewhere()
