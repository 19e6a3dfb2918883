"""What a buffer's layout fixes on one rank, shared by every buffer of that layout."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from dbuffer._private.layout import BufferLayout, TensorSlot, slots_for
from dbuffer._private.storage import mesh_device

__all__ = ["BufferGeometry"]


class BufferGeometry:
    """A layout on a mesh, seen from this rank: the shard axis and its size, this rank's index,
    each tensor's slot, placements and (per dtype) DTensor specs. Derived once; buffers of the
    same layout (``DBuffer.new_like``: gradients, optimizer states) share it, so making one
    costs no Python step per rank or per tensor beyond its views."""

    def __init__(
        self,
        layout: BufferLayout,
        shapes: Sequence[Sequence[int]],
        mesh: DeviceMesh,
        *,
        names: Sequence[str] | None = None,
        shard_axis: int = -1,
        device: torch.device | None = None,
    ) -> None:
        if not isinstance(layout, BufferLayout):
            raise TypeError(
                f"layout {type(layout).__name__} does not satisfy dbuffer.BufferLayout "
                f"(shard_size, world_size, offsets, numels, fingerprint, local_units(i))"
            )
        self.layout = layout
        self.mesh = mesh
        self.device = mesh_device(mesh) if device is None else torch.device(device)
        if self.device.type not in (mesh.device_type, "meta"):
            raise ValueError(
                f"DBuffer: device {self.device} is not of the mesh's type {mesh.device_type!r}"
            )
        axis = shard_axis % mesh.ndim if -mesh.ndim <= shard_axis < mesh.ndim else None
        if axis is None:
            raise ValueError(f"shard_axis {shard_axis} is not an axis of the {mesh.ndim}-D mesh")
        self.shard_axis = axis
        self.replicate_axes = tuple(a for a in range(mesh.ndim) if a != axis)
        self.world_size = mesh.size(axis)
        if int(layout.world_size) != self.world_size:
            raise ValueError(
                f"layout is for world_size {layout.world_size} but mesh axis {axis} "
                f"has {self.world_size} ranks"
            )
        self.rank = mesh.get_local_rank(axis)
        self.shard_size = int(layout.shard_size)
        count = len(shapes)
        self.names = (
            tuple(names) if names is not None else tuple(f"tensor[{i}]" for i in range(count))
        )
        self.slots: tuple[TensorSlot, ...] = slots_for(layout, shapes, self.names, self.rank)
        self.shapes = tuple(s.shape for s in self.slots)
        self.placements = tuple(self._placements_of(slot) for slot in self.slots)
        self._specs: dict[torch.dtype, tuple[DTensorSpec, ...]] = {}

    def on(self, device: torch.device) -> BufferGeometry:
        """The same geometry for a buffer on another device of the mesh's type (or ``meta``):
        slots, placements and specs shared."""
        if device == self.device:
            return self
        if device.type not in (self.mesh.device_type, "meta"):
            raise ValueError(
                f"DBuffer: device {device} is not of the mesh's type {self.mesh.device_type!r}"
            )
        other = BufferGeometry.__new__(BufferGeometry)
        other.__dict__.update(self.__dict__)
        other.device = device
        return other

    def _placements_of(self, slot: TensorSlot) -> tuple[Placement, ...]:
        placements: list[Placement] = [Replicate()] * self.mesh.ndim
        placements[self.shard_axis] = slot.placement
        return tuple(placements)

    def specs(self, dtype: torch.dtype) -> tuple[DTensorSpec, ...]:
        """Each tensor's DTensor spec in ``dtype``, built once per dtype.

        ``slots_for`` has already checked everything ``DTensor.from_local`` would check for a
        RaggedShard (units per rank, the unit dividing the tensor, this rank's share), so the
        spec is built directly: ``from_local``'s checks cost a Python step per rank (thousands
        at scale)."""
        specs = self._specs.get(dtype)
        if specs is None:
            specs = tuple(
                DTensorSpec(
                    self.mesh,
                    placements,
                    tensor_meta=TensorMeta(torch.Size(slot.shape), slot.stride, dtype),
                )
                for slot, placements in zip(self.slots, self.placements, strict=True)
            )
            self._specs[dtype] = specs
        return specs

    def record(self, dtype: torch.dtype) -> dict[str, str]:
        """What every rank must agree on before a collective of a buffer of this layout."""
        shapes = hashlib.sha256(repr(self.shapes).encode()).hexdigest()[:16]
        return {
            "layout fingerprint": str(self.layout.fingerprint),
            "shard_size": str(self.shard_size),
            "dtype": str(dtype),
            "shapes digest": shapes,
            "number of tensors": str(len(self.slots)),
        }

    def same(self, other: BufferGeometry) -> bool:
        """True if ``other`` lays out the same tensors the same way on the same mesh."""
        return other is self or (
            self.mesh == other.mesh
            and self.shard_axis == other.shard_axis
            and self.shard_size == other.shard_size
            and self.shapes == other.shapes
            and [s.offset for s in self.slots] == [s.offset for s in other.slots]
        )
