"""dbuffer: the distributed flat buffer.

One flat storage per group of tensors, sharded over a mesh axis by a layout (``BufferLayout``):
the tensors' shards are zero-copy ``RaggedShard`` DTensor views of the shard storage, their full
values zero-copy views of an unsharded storage that exists only between ``unshard`` and
``reshard``; one all-gather / reduce-scatter per group, fused group ops, mixed precision on demand.
Loading full tensors, DTensor views of the shards, attaching gradients and the memory and copy
tallies (``LiveBytes``, ``CopiedBytes``) are in ``dbuffer.testing``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from dbuffer._private.agreement import LayoutMismatchError
from dbuffer._private.buffer import DBuffer
from dbuffer._private.collectives import AllGatherComm, Handle, ReduceScatterComm
from dbuffer._private.layout import BufferLayout, ContiguousLayout, contiguous_layout
from dbuffer._private.packed import PackedAllGather, PackedLayout, packed_layout
from dbuffer._private.reduction import Op as ReduceOp
from dbuffer._private.reduction import ReduceSpec, avg_supported, reduce_spec
from dbuffer._private.streams import on_all_gather_stream

try:
    __version__ = version("dbuffer")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    # the buffer
    "DBuffer",
    "Handle",
    "ReduceOp",
    "ReduceSpec",
    "reduce_spec",
    "avg_supported",
    "AllGatherComm",
    "ReduceScatterComm",
    "on_all_gather_stream",
    "LayoutMismatchError",
    # packed (byte) all-gathers: quantized codes and scales in one collective
    "PackedAllGather",
    "PackedLayout",
    "packed_layout",
    # layouts
    "BufferLayout",
    "ContiguousLayout",
    "contiguous_layout",
    "__version__",
]
