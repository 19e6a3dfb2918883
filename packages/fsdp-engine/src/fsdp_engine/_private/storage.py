"""A group's sharded values: one planned flat buffer, and how each parameter maps onto it.

[Note: plan, then hold]
A group asks the planner for a layout (each parameter contiguous, no block cut, equal shards),
then holds the parameters' values in a ``DBuffer``: the registered parameters are DTensors whose
local tensors are views of the shard storage (what the optimizer updates, in place), and the
parameters used in forward/backward are views of the unsharded storage one all-gather fills.
Three layouts share this storage:

- planned (the default): each parameter's share is a flat ``RaggedShard`` range;
- placed (``shard_placement_fn`` returned ``Shard(d)``): FSDP2's own layout of those
  parameters ([Note: placed groups]): each rank's shard holds every parameter's chunk, so the
  gathered buffer needs a copy into each parameter's own order (one ``Shard(0)`` parameter
  alone excepted).

[Note: meta-device parameters]
A group built from meta parameters keeps meta sharded parameters (FSDP2's behaviour), and its
buffer is a ``meta`` buffer: ``fully_shard`` of a meta model allocates and touches nothing.
``to_empty`` / ``load_state_dict(assign=True)`` / a replaced parameter materializes it: a buffer
of the same layout on the real device, reserved, not written (only the padding between the
parameters is zeroed: values there travel in the collectives), and every sharded parameter's
local tensor becomes its view (``FSDPParam.adopt*``); the group rebuilds what viewed the meta
buffer (``generation``).

[Note: bit-cast storage]
Collectives do not carry every dtype (gloo rejects float8). A group of such a dtype stores its
buffer as the same bytes in an integer dtype of the same width: the collectives move those
bytes, and every parameter view reinterprets them (``Tensor.view(dtype)``, no copy). Such a
group is not cast to ``param_dtype`` and cannot reduce gradients.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from dbuffer import DBuffer
from fsdp_engine._private import compat
from fsdp_engine._private.api import MixedPrecisionPolicy
from fsdp_engine._private.param import TPSpec
from fsdp_engine._private.placed import PlacedLayout, placed_tp_dtensor
from ragged_dtensor import from_local as ragged_from_local
from shard_planner import Plan

__all__ = ["ShardStorage", "gap_index", "group_dtypes", "storage_dtype"]

_BITCAST = {
    dtype: torch.uint8
    for dtype in (
        getattr(torch, name, None)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    )
    if dtype is not None
}


def storage_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a group of ``dtype`` stores and communicates ([Note: bit-cast storage])."""
    return _BITCAST.get(dtype, dtype)


class ShardStorage:
    """The sharded values of one group (module Note): the flat buffer, the parameters' dtype,
    the layout's kind, and each parameter's local share, full-value part and DTensor."""

    def __init__(
        self,
        plan: Plan,
        names: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        mesh: DeviceMesh,
        *,
        dtype: torch.dtype,
        shard_axis: int,
        device: torch.device,
        tp_specs: Sequence[TPSpec | None],
        placed: PlacedLayout | None = None,
        meta: bool = False,
    ) -> None:
        self.plan = plan
        self.mesh = mesh
        self.shard_axis = shard_axis
        self.world = mesh.size(shard_axis)
        self.names = tuple(names)
        self.shapes = tuple(shapes)
        self.placed = placed
        self.tp_specs = tuple(tp_specs)
        # [Note: placed groups]: copied out of / into the gathered order
        self.copies = placed is not None and not placed.zero_copy
        self.dtype = dtype
        buffer_shapes = [(plan.numels[0],)] if placed is not None else list(shapes)
        self.buffer = DBuffer(
            plan,
            buffer_shapes,
            mesh,
            dtype=storage_dtype(dtype),
            names=[plan.names[0]] if placed is not None else list(names),
            shard_axis=shard_axis,
            check=True,
            device=torch.device("meta") if meta else device,
            zero=not meta,
        )
        self.rank = self.buffer.rank
        self.device = torch.device(device)  # where the values live once materialized
        self.materialized = not meta
        self.generation = 0  # bumped when the buffer is replaced (materialize, retype)
        self._full: weakref.WeakKeyDictionary[DBuffer, dict[torch.dtype, list[torch.Tensor]]]
        self._full = weakref.WeakKeyDictionary()

    @property
    def bitcast(self) -> bool:
        return self.buffer.dtype != self.dtype

    # -- each parameter's share ---------------------------------------------------------------
    def local_shape(self, i: int) -> tuple[int, ...]:
        """The shape of parameter ``i``'s local tensor: flat (RaggedShard), or its chunk."""
        if self.placed is not None:
            return self.placed.local_shape(i, self.rank)
        return (self.buffer.slots[i].local_numel,)

    def local_views(self, buffer: DBuffer) -> list[torch.Tensor]:
        """Each parameter's share of ``buffer``'s shard (a buffer of this layout: the
        parameters', or their gradients'), flat, in the buffer's dtype."""
        if self.placed is None:
            return list(buffer.local_views())
        placed = self.placed
        return [
            buffer.shard[off : off + placed.local_numel(i, self.rank)]
            for i, off in enumerate(placed.offsets)
        ]

    def local(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s share of the shard storage, in the parameters' dtype (a view)."""
        placed = self.placed
        if placed is None:  # one view, not the list of all (setup calls this per parameter)
            return self.buffer.local_views()[i].view(self.dtype)
        off = placed.offsets[i]
        flat = self.buffer.shard[off : off + placed.local_numel(i, self.rank)]
        return flat.view(self.dtype).view(self.local_shape(i))

    def local_or_meta(self, i: int, meta: bool) -> torch.Tensor:
        local = self.local(i)
        return torch.empty(local.shape, dtype=local.dtype, device="meta") if meta else local

    def full_views(self, buffer: DBuffer, dtype: torch.dtype) -> list[torch.Tensor]:
        """Each parameter's full value as a view of ``buffer``'s unsharded storage of
        ``dtype`` (the same objects every call); not for a group that copies out."""
        if self.placed is None:
            return list(buffer.full_views(dtype, allow_released=True))
        assert not self.copies, "a placed group's unsharded parameters are copies"
        per_dtype = self._full.setdefault(buffer, {})
        views = per_dtype.get(dtype)
        if views is None:
            flat = buffer.unsharded_flat(dtype)
            offsets = self.placed.offsets
            views = per_dtype[dtype] = [
                flat[off : off + math.prod(shape)].view(shape)
                for off, shape in zip(offsets, self.shapes, strict=True)
            ]
        return views

    def part_of_full(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``i``'s full value, flat."""
        if self.placed is not None:
            return self.placed.part_of_full(i, full, self.rank)
        slot = self.buffer.slots[i]
        return full.reshape(-1)[slot.tensor_start : slot.tensor_start + slot.local_numel]

    def load_full(self, i: int, full: torch.Tensor) -> None:
        with torch.no_grad():
            self.local(i).view(-1).copy_(self.part_of_full(i, full))

    # -- DTensors -----------------------------------------------------------------------------
    def placements(self, i: int) -> tuple[Placement, ...]:
        """Parameter ``i``'s placements on the data-parallel mesh."""
        if self.placed is not None:
            return (Replicate(),) * (self.mesh.ndim - 1) + (Shard(self.placed.dims[i]),)
        return self.buffer.placements[i]

    def dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        """A DTensor over ``local`` (this rank's share of parameter ``i``, no copy), its wrapper
        at storage offset 0 ([Note: DTensors over views] in compat: ``torch.save`` works)."""
        return compat.offset_free(self._dtensor(i, local))

    def _dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        tp = self.tp_specs[i]
        if self.placed is not None and tp is not None:  # [Note: placed groups]
            return placed_tp_dtensor(
                local.view(self.local_shape(i)), self.mesh, self.placed.dims[i], tp
            )
        if self.placed is not None:
            shape = self.shapes[i]
            return DTensor.from_local(
                local.view(self.local_shape(i)),
                self.mesh,
                self.placements(i),
                run_check=False,
                shape=torch.Size(shape),
                stride=torch.empty(shape, device="meta").stride(),
            )
        slot = self.buffer.slots[i]
        if tp is None and not local.requires_grad and local.numel() == slot.local_numel:
            # The buffer's layout checked every rank's units when it was built, so its spec is
            # used as it is (dbuffer's ``specs``): ragged ``from_local`` would check them again
            # and build an autograd node, per parameter (seconds for 10,000 parameters).
            spec = self.buffer.geometry.specs(local.dtype)[i]
            return compat.dtensor_from_spec(local.view(-1), spec)
        # ragged_dtensor's from_local checks this rank's units against the placement
        if tp is None:
            return ragged_from_local(
                local,
                self.mesh,
                self.placements(i),
                run_check=False,
                shape=torch.Size(slot.shape),
                stride=slot.stride,
            )
        placements = tp.sharded_placements(self.placements(i))
        return ragged_from_local(
            local, tp.spmd_mesh, placements, run_check=False, shape=tp.shape, stride=tp.stride
        )

    def grad_dtensor(self, i: int, local: torch.Tensor, like: DTensor) -> DTensor:
        """Parameter ``i``'s sharded gradient over ``local``: ``like``'s spec (the sharded
        parameter's: same shape, placements and dtype) when it has no tensor parallelism, so no
        per-rank check runs again (``from_local`` checks every rank's units)."""
        local = local.view(self.local_shape(i))
        spec = compat.spec_of(like)
        meta = spec.tensor_meta
        if self.tp_specs[i] is None and meta is not None and meta.dtype == local.dtype:
            return compat.dtensor_from_spec(local, spec)
        return self.dtensor(i, local)

    def unsharded_view(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """The unsharded parameter over ``full``: a DTensor on the tensor-parallel mesh for a
        tensor-parallel parameter, ``full`` itself otherwise."""
        tp = self.tp_specs[i]
        if tp is None:
            return full
        return DTensor.from_local(
            full, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride
        )

    # -- meta and dtype changes ---------------------------------------------------------------
    def materialize(self) -> bool:
        """[Note: meta-device parameters]: the buffer on the real device, reserved, only the
        padding written; True if it was on meta."""
        if self.materialized:
            return False
        self.buffer = self.buffer.new_like(zero=False, device=self.device)
        self._zero_padding()
        self.materialized = True
        self.generation += 1
        return True

    def _zero_padding(self) -> None:
        shard = self.buffer.shard
        base = int(shard.storage_offset())
        spans = [
            (int(local.storage_offset()) - base, local.numel())
            for local in self.local_views(self.buffer)
        ]
        gaps = gap_index(spans, shard.numel(), shard.device)
        if gaps.numel():
            with compat.no_grad_and_preserved(shard):
                shard.index_fill_(0, gaps, 0)

    def retype(self, dtype: torch.dtype) -> None:
        """Hold the parameters in ``dtype`` from now on (``module.to(dtype)``): a new buffer
        of the same layout (on meta while not materialized), values to be written by the
        caller."""
        self.buffer = self.buffer.new_like(storage_dtype(dtype), zero=False)
        if self.materialized:
            self._zero_padding()
        self.dtype = dtype
        self.generation += 1


def is_view_of(tensor: torch.Tensor, local: torch.Tensor) -> bool:
    """Whether ``tensor`` (or its local tensor) starts where ``local`` does, in the same memory."""
    inner = compat.local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
    return compat.starts_at(inner, local)


def gap_index(spans: Sequence[tuple[int, int]], total: int, device: torch.device) -> torch.Tensor:
    """The indices of ``[0, total)`` that no ``(start, length)`` span covers (the padding
    between a buffer's tensors: small, whatever the buffer's size)."""
    gaps: list[torch.Tensor] = []
    cursor = 0
    for start, length in sorted(s for s in spans if s[1] > 0):
        if start > cursor:
            gaps.append(torch.arange(cursor, start))
        cursor = max(cursor, start + length)
    if cursor < total:
        gaps.append(torch.arange(cursor, total))
    index = torch.cat(gaps) if gaps else torch.empty(0, dtype=torch.int64)
    return index.to(device)


def group_dtypes(
    dtype: torch.dtype, policy: MixedPrecisionPolicy, *, bitcast_dtype: torch.dtype | None
) -> tuple[torch.dtype, torch.dtype, torch.dtype]:
    """A group's compute, all-gather and reduce dtypes for parameters of ``dtype`` under
    ``policy``: the policy's for floating dtypes a collective carries, else ``dtype``; the
    all-gather moves the same bytes as ``bitcast_dtype`` integers where collectives do not
    carry ``dtype`` ([Note: bit-cast storage])."""
    floating = dtype.is_floating_point and storage_dtype(dtype) == dtype
    compute = (policy.param_dtype if floating else None) or dtype
    reduce = (policy.reduce_dtype if floating else None) or compute
    return compute, bitcast_dtype or compute, reduce
