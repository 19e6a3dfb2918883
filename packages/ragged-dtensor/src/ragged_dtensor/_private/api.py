"""Public helpers with torch-DTensor semantics for ragged layouts.

With the hooks of ``compat.py`` installed (they are, on import), torch's own ``distribute_tensor``,
``DTensor.from_local``, ``redistribute`` and ``full_tensor`` accept RaggedShard; the functions here
are the same operations spelled explicitly, plus the local geometry of a ragged DTensor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor._private.agreement import check_ranks_agree
from ragged_dtensor._private.geometry import FlatRange
from ragged_dtensor._private.placement import RaggedShard
from ragged_dtensor._private.redistribute import ragged_axis, x_shape

__all__ = [
    "check_ragged_local",
    "distribute_ragged",
    "distribute_tensor",
    "from_local",
    "local_box",
    "local_range",
    "redistribute",
]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride = []
    acc = 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(1, s)
    return tuple(reversed(stride))


def _check_placements(
    mesh: DeviceMesh,
    placements: Sequence[Placement],
    shape: Sequence[int],
) -> tuple[int, RaggedShard, tuple[int, ...]]:
    if len(placements) != mesh.ndim:
        raise ValueError(
            f"{len(placements)} placements {tuple(placements)} for a "
            f"{mesh.ndim}-D mesh: expected one placement per mesh axis"
        )
    axis = ragged_axis(placements)
    assert axis is not None
    placement = placements[axis]
    assert isinstance(placement, RaggedShard)
    if len(placement.local_units) != mesh.size(axis):
        raise ValueError(
            f"{placement!r} on mesh axis {axis}: {len(placement.local_units)} "
            f"local_units but the axis has {mesh.size(axis)} ranks"
        )
    xs = x_shape(shape, mesh, placements)
    placement.validate(xs, where=f"mesh axis {axis}")
    return axis, placement, xs


def distribute_ragged(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement],
    original: Callable[..., DTensor],
    **kwargs: Any,
) -> DTensor:
    """torch's distribute_tensor with the ragged axis cut locally from the replicated value."""
    if device_mesh is None:
        raise ValueError("distribute_tensor with a RaggedShard placement needs device_mesh")
    axis, placement, xs = _check_placements(device_mesh, placements, tuple(tensor.shape))
    standard = [Replicate() if i == axis else p for i, p in enumerate(placements)]
    base = original(tensor, device_mesh, standard, **kwargs)
    coordinate = device_mesh.get_local_rank(axis)
    flat = placement.flat_range(xs, coordinate)
    local = base.to_local().detach().reshape(-1)[flat.start : flat.stop]
    spec = DTensorSpec(
        device_mesh,
        tuple(placements),
        tensor_meta=TensorMeta(tensor.shape, _contiguous_stride(tensor.shape), tensor.dtype),
    )
    return DTensor(  # type: ignore[no-untyped-call]
        local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad
    )


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``torch.distributed.tensor.distribute_tensor``, accepting RaggedShard (same semantics)."""
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    return torch_distribute(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def check_ragged_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement],
    *,
    shape: torch.Size | None = None,
    stride: tuple[int, ...] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Validate a ragged local tensor for ``DTensor.from_local``; returns (flat local, kwargs)."""
    if device_mesh is None:
        raise ValueError("DTensor.from_local with a RaggedShard placement needs device_mesh")
    if shape is None:
        raise ValueError(
            "DTensor.from_local with a RaggedShard placement needs shape=: the "
            "global shape cannot be inferred from a flat ragged share"
        )
    axis, placement, xs = _check_placements(device_mesh, placements, tuple(shape))
    contiguous = _contiguous_stride(tuple(shape))
    if stride is not None and tuple(stride) != contiguous:
        raise ValueError(
            f"RaggedShard needs a row-major tensor: stride {tuple(stride)} given for "
            f"shape {tuple(shape)}, expected {contiguous}"
        )
    if not local_tensor.is_contiguous():
        raise ValueError(
            f"the local tensor of a RaggedShard DTensor must be contiguous (got "
            f"shape {tuple(local_tensor.shape)}, stride {local_tensor.stride()})"
        )
    coordinate = device_mesh.get_local_rank(axis)
    expected = placement.local_numel(xs, coordinate)
    if local_tensor.numel() != expected:
        raise ValueError(
            f"rank with coordinate {coordinate} on mesh axis {axis}: local tensor has "
            f"{local_tensor.numel()} elements but {placement!r} on shape {xs} gives "
            f"it {placement.local_units[coordinate]} units = {expected} elements"
        )
    if kwargs.get("run_check", False):
        _check_ranks_agree(device_mesh, axis, placements, tuple(shape))
        # torch's own run_check compares local metadata, which legitimately differs here
        kwargs["run_check"] = False
    kwargs.update(shape=torch.Size(shape), stride=contiguous)
    return local_tensor.reshape(-1), kwargs


def _check_ranks_agree(
    mesh: DeviceMesh, axis: int, placements: Sequence[Placement], shape: tuple[int, ...]
) -> None:
    """Every rank of the ragged axis must describe the same global tensor: compare (the common
    agreement check) and raise on all of them."""
    check_ranks_agree(
        mesh.get_group(axis),
        {"placements": repr(tuple(placements)), "global shape": repr(shape)},
        what=(
            f"DTensor.from_local(run_check=True): ranks disagree on the ragged layout "
            f"(local_units, dims, shape) on mesh axis {axis}"
        ),
    )


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh,
    placements: Sequence[Placement],
    *,
    shape: Sequence[int],
    requires_grad: bool | None = None,
) -> DTensor:
    """Wrap this rank's flat share as a DTensor (validated against the units; no communication)."""
    dt = DTensor.from_local(
        local_tensor, device_mesh, placements, shape=torch.Size(shape), run_check=False
    )
    if requires_grad is not None:
        dt.requires_grad_(requires_grad)
    return dt


def redistribute(
    dt: DTensor, placements: Sequence[Placement], device_mesh: DeviceMesh | None = None
) -> DTensor:
    """``dt.redistribute(...)``: one collective per changed axis for ragged transitions."""
    return dt.redistribute(device_mesh or dt.device_mesh, tuple(placements))


def _ragged_geometry(dt: DTensor) -> tuple[RaggedShard, tuple[int, ...], int]:
    """(placement, X's shape, this rank's coordinate on the ragged axis) of a ragged DTensor."""
    axis = ragged_axis(dt.placements)
    if axis is None:
        raise ValueError(f"DTensor with placements {dt.placements} has no RaggedShard")
    placement = dt.placements[axis]
    assert isinstance(placement, RaggedShard)
    xs = x_shape(tuple(dt.shape), dt.device_mesh, dt.placements)
    return placement, xs, dt.device_mesh.get_local_rank(axis)


def local_range(dt: DTensor) -> FlatRange:
    """This rank's flat range of X (the tensor the ragged axis cuts) for a ragged DTensor."""
    placement, xs, coordinate = _ragged_geometry(dt)
    return placement.flat_range(xs, coordinate)


def local_box(dt: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local_shape, global_offset)`` of a ragged DTensor whose share is a box of X.

    Offsets are in X's coordinates (equal to global ones on a 1-D mesh).
    """
    placement, xs, coordinate = _ragged_geometry(dt)
    return placement.local_box(xs, coordinate)
