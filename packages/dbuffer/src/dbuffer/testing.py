"""Tests' and measurements' tools for ``DBuffer``; no package uses them.

- ``load_full_(buffer, tensors)``: copy this rank's share of full tensors into a buffer;
- ``sharded_views(buffer)``: each tensor's shard as a ``RaggedShard`` DTensor over the buffer;
- ``attach_grads(buffer, params)``: ``params[i].grad`` a view of the buffer's unsharded storage;
- ``views_held_elsewhere(buffer)``: whether ``release_shard`` would keep the shard storage;
- ``LiveBytes`` / ``CopiedBytes``: dispatch modes tallying live storage bytes (peak, current)
  and bytes written by copy-like ops, for memory and copy measurements on any device (CPU
  included, where torch keeps no allocator statistics).
"""

from __future__ import annotations

from dbuffer._private.conveniences import (
    attach_grads,
    load_full_,
    sharded_views,
    views_held_elsewhere,
)
from dbuffer._private.measure import CopiedBytes, LiveBytes

__all__ = [
    "load_full_",
    "sharded_views",
    "attach_grads",
    "views_held_elsewhere",
    "LiveBytes",
    "CopiedBytes",
]
