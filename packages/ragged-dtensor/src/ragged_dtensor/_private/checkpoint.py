"""torch.distributed.checkpoint support for ragged DTensors.

[Note: a flat share is a few boxes]
DCP describes every local piece of a tensor as a box (offsets, sizes) of the global tensor. A ragged
share is a contiguous flat range of X's row-major storage; any such range is the union of at most
``2 * ndim - 1`` contiguous boxes (``geometry.flat_range_to_boxes``), and each box is a *view* of
the local tensor. So a rank writes (and reads into) several chunks of one tensor, and DCP's own
planner reshards them to any other layout or world size on load: nothing is gathered. A
zero-element tensor is one empty box (no flat range has a box), so its key is still saved.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate

from ragged_dtensor._private.geometry import flat_range_to_boxes
from ragged_dtensor._private.placement import RaggedShard
from ragged_dtensor._private.redistribute import ragged_axis

__all__ = ["create_chunk_list", "create_write_items", "get_tensor_shard", "ragged_chunks"]


def ragged_chunks(dt: Any) -> list[tuple[torch.Size, torch.Size, torch.Tensor]]:
    """``(global_offset, size, view)`` of every box of this rank's ragged share."""
    shape = torch.Size(dt._spec.shape)
    if math.prod(shape) == 0:
        # A zero-element tensor: no rank's flat range has a box, yet DCP must still record the
        # key (else the load reports it missing). One empty box covering the whole tensor, the
        # same on every rank (DCP's deduplication keeps one).
        return [(torch.Size([0] * len(shape)), shape, dt._local_tensor.reshape(shape))]
    axis = ragged_axis(dt.placements)
    assert axis is not None
    placement = dt.placements[axis]
    assert isinstance(placement, RaggedShard)
    mesh = dt.device_mesh
    standard = [Replicate() if i == axis else p for i, p in enumerate(dt.placements)]
    xs, x_offset = compute_local_shape_and_global_offset(shape, mesh, standard)
    flat = placement.flat_range(xs, mesh.get_local_rank(axis))
    local = dt._local_tensor.reshape(-1)
    chunks = []
    for offset, size, sub in flat_range_to_boxes(xs, flat):
        view = local[sub.start - flat.start : sub.stop - flat.start].view(size)
        global_offset = torch.Size(o + x for o, x in zip(offset, x_offset, strict=True))
        chunks.append((global_offset, torch.Size(size), view))
    return chunks


def create_write_items(dt: Any, fqn: str, obj: Any) -> list[WriteItem]:
    """DCP's write items of a ragged DTensor: one per box of this rank's share."""
    dt._raise_if_contains_partial_placements()
    properties = TensorProperties.create_from_tensor(dt._local_tensor)
    return [
        WriteItem(
            index=MetadataIndex(fqn, offset),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offset, sizes=size),
                properties=properties,
                size=torch.Size(dt._spec.shape),
            ),
        )
        for offset, size, _ in ragged_chunks(dt)
    ]


def create_chunk_list(dt: Any) -> list[ChunkStorageMetadata]:
    """DCP's chunks of a ragged DTensor (what this rank reads into on load)."""
    dt._raise_if_contains_partial_placements()
    return [ChunkStorageMetadata(offsets=o, sizes=s) for o, s, _ in ragged_chunks(dt)]


def get_tensor_shard(dt: Any, index: MetadataIndex) -> torch.Tensor:
    """The view of this rank's share that DCP's ``index`` names (written from, or read into)."""
    dt._raise_if_contains_partial_placements()
    for offset, _, view in ragged_chunks(dt):
        if index.offset is not None and offset == torch.Size(index.offset):
            return view
    raise ValueError(
        f"checkpoint asked {index.fqn!r} for a chunk at offset {index.offset}, "
        f"which this rank's ragged share {dt.placements} does not hold"
    )
