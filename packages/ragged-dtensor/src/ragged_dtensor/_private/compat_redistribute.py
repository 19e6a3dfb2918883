"""The redistribution hook of the DTensor integration (compat.py, part 1 of its Note): ragged
redistributions and the ragged views, delegating to torch's function for every other spec."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private.compat_base import _spec_has_ragged, _torch_functions
from ragged_dtensor._private.fallback import (
    FallbackSpec,
    check_fallback,
)
from ragged_dtensor._private.placement import (
    RaggedBoxView,
    RaggedBroadcastView,
    RaggedNonEmptyView,
    RaggedPaddedView,
    RaggedShard,
)
from ragged_dtensor._private.redistribute import execute, plan_redistribute, ragged_axis, x_shape


def _torch_redistribute(
    mesh: DeviceMesh,
    meta: TensorMeta | None,
) -> Callable[[torch.Tensor, tuple[Placement, ...], tuple[Placement, ...]], torch.Tensor]:
    original = _torch_functions().redistribute

    def run(
        local: torch.Tensor, before: tuple[Placement, ...], after: tuple[Placement, ...]
    ) -> torch.Tensor:
        src = DTensorSpec(mesh, before, tensor_meta=meta)
        dst = DTensorSpec(mesh, after, tensor_meta=meta)
        return original(local, src, dst)

    return run


def ragged_redistribute_local(
    local: torch.Tensor,
    current: DTensorSpec,
    target: DTensorSpec,
) -> torch.Tensor:
    """Redistribute a local tensor between specs of which at least one is ragged."""
    if current.mesh != target.mesh:
        raise NotImplementedError("redistributing a ragged DTensor across device meshes")
    mesh = current.mesh
    shape = tuple(current.shape)
    for spec, role in ((current, "source"), (target, "target")):
        axis = ragged_axis(spec.placements)
        if axis is not None:
            placement = spec.placements[axis]
            assert isinstance(placement, RaggedShard)
            if len(placement.local_units) != mesh.size(axis):
                raise ValueError(
                    f"{role} placement {placement!r} on mesh axis {axis}: "
                    f"{len(placement.local_units)} local_units for "
                    f"{mesh.size(axis)} ranks"
                )
    src_x = x_shape(shape, mesh, current.placements)
    dst_x = x_shape(shape, mesh, target.placements)
    steps = plan_redistribute(
        tuple(mesh.shape), tuple(current.placements), tuple(target.placements), src_x, dst_x
    )
    axis = ragged_axis(current.placements)
    if axis is not None:
        expected = steps_expected_local(current, src_x, mesh, axis)
        if local.numel() != expected:
            raise ValueError(
                f"local tensor of {local.numel()} elements does not match "
                f"{current.placements[axis]!r} on shape {src_x} (expected "
                f"{expected} on mesh-axis coordinate {mesh.get_local_rank(axis)})"
            )
    return execute(steps, local, mesh, _torch_redistribute(mesh, current.tensor_meta))


def steps_expected_local(spec: DTensorSpec, xs: Sequence[int], mesh: DeviceMesh, axis: int) -> int:
    placement = spec.placements[axis]
    assert isinstance(placement, RaggedShard)
    return placement.local_numel(xs, mesh.get_local_rank(axis))


def _box_view(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec) -> torch.Tensor:
    """RaggedShard -> RaggedBoxView of the same layout: the flat share viewed as its box."""
    axis = ragged_axis(target.placements)
    assert axis is not None
    placement = target.placements[axis]
    assert isinstance(placement, RaggedShard)
    if tuple(current.placements) != tuple(
        RaggedShard(p.dims, p.local_units) if isinstance(p, RaggedBoxView) else p
        for p in target.placements
    ):
        raise AssertionError(f"box view of {current.placements} as {target.placements}")
    xs = x_shape(tuple(current.shape), current.mesh, current.placements)
    shape, _ = placement.local_box(xs, current.mesh.get_local_rank(axis))
    return local.view(shape)


def _padded_view(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec) -> torch.Tensor:
    """RaggedShard -> RaggedPaddedView: the flat share written into X's full shape, the rest
    set to the view's fill value (a local copy)."""
    axis = ragged_axis(target.placements)
    assert axis is not None
    placement = target.placements[axis]
    assert isinstance(placement, RaggedPaddedView)
    xs = x_shape(tuple(current.shape), current.mesh, current.placements)
    flat = placement.flat_range(xs, current.mesh.get_local_rank(axis))
    fill = _fill_value(placement.fill, local.dtype)
    full = torch.full(xs, fill, dtype=local.dtype, device=local.device)
    full.view(-1)[flat.start : flat.stop] = local.reshape(-1)
    return full


def _fill_value(fill: float, dtype: torch.dtype) -> float | int | bool:
    """``fill`` in ``dtype``: an infinite fill of an integer dtype is its extreme."""
    if dtype.is_floating_point or dtype.is_complex or not math.isinf(fill):
        return fill
    if dtype == torch.bool:
        return fill > 0
    info = torch.iinfo(dtype)
    return info.max if fill > 0 else info.min


def _non_empty_view(local: torch.Tensor, target: DTensorSpec) -> torch.Tensor:
    """RaggedShard -> RaggedNonEmptyView: an empty share becomes one element ``fill``."""
    if local.numel():
        return local
    axis = ragged_axis(target.placements)
    assert axis is not None
    placement = target.placements[axis]
    assert isinstance(placement, RaggedNonEmptyView)
    fill = _fill_value(placement.fill, local.dtype)
    return torch.full((1,), fill, dtype=local.dtype, device=local.device)


def _broadcast_view(local: torch.Tensor, current: DTensorSpec, target: DTensorSpec) -> torch.Tensor:
    """Replicate -> RaggedBroadcastView: this rank's share of the operand broadcast to the
    view's shape, copied from the few rows it covers (about the share's size)."""
    axis = ragged_axis(target.placements)
    assert axis is not None
    placement = target.placements[axis]
    assert isinstance(placement, RaggedBroadcastView)
    shape = placement.shape
    rank = target.mesh.get_local_rank(axis)
    source = ragged_axis(current.placements)
    if source is not None:  # a ragged operand of whole rows: expand each row locally
        held = current.placements[source]
        assert isinstance(held, RaggedShard)
        box, _ = held.local_box(tuple(current.shape), rank)
        return local.view(box).expand((box[0], *shape[1:])).reshape(-1)
    flat = placement.flat_range(shape, rank)
    row = math.prod(shape[1:])
    if not shape or row == 0:
        return local.expand(shape).reshape(-1)[flat.start : flat.stop]
    first, last = flat.start // row, -(-flat.stop // row)
    rows = local.expand(shape)[first:last].reshape(-1)
    return rows[flat.start - first * row : flat.stop - first * row]


def _redistribute_hook(
    local_tensor: torch.Tensor,
    current_spec: DTensorSpec,
    target_spec: DTensorSpec,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    if any(isinstance(p, RaggedPaddedView) for p in target_spec.placements):
        return _padded_view(local_tensor, current_spec, target_spec)
    if any(isinstance(p, RaggedNonEmptyView) for p in target_spec.placements):
        return _non_empty_view(local_tensor, target_spec)
    if any(isinstance(p, RaggedBroadcastView) for p in target_spec.placements):
        return _broadcast_view(local_tensor, current_spec, target_spec)
    if any(isinstance(p, RaggedBoxView) for p in target_spec.placements):
        return _box_view(local_tensor, current_spec, target_spec)
    if isinstance(target_spec, FallbackSpec):
        check_fallback(current_spec, target_spec)
    if _spec_has_ragged(current_spec) or _spec_has_ragged(target_spec):
        return ragged_redistribute_local(local_tensor, current_spec, target_spec)
    return _torch_functions().redistribute(local_tensor, current_spec, target_spec, *args, **kwargs)


def _local_numel(spec: DTensorSpec) -> int:
    axis = ragged_axis(spec.placements)
    assert axis is not None
    return steps_expected_local(
        spec, x_shape(tuple(spec.shape), spec.mesh, spec.placements), spec.mesh, axis
    )


def _x_shape_of(spec: DTensorSpec) -> tuple[int, ...]:
    return x_shape(tuple(spec.shape), spec.mesh, spec.placements)
