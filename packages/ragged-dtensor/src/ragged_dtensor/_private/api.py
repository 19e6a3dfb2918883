"""Public helpers with torch-DTensor semantics for ragged layouts.

``distribute_tensor`` and ``from_local`` are torch's functions of the same names, also accepting
RaggedShard placements (torch's own refuse a RaggedShard, or cannot infer its global shape): with
standard placements they call torch's unchanged. ``redistribute`` and the local geometry of a
ragged DTensor complete them. (``dt.redistribute``, ``dt.full_tensor`` and ops go through
torch's DTensor, with the integration of ``compat.py``.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor._private import compat
from ragged_dtensor._private.agreement import check_ranks_agree
from ragged_dtensor._private.geometry import FlatRange
from ragged_dtensor._private.placement import RaggedShard
from ragged_dtensor._private.redistribute import ragged_axis, x_shape
from ragged_dtensor._private.state_dict import share_into

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
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """torch's distribute_tensor with each rank's share cut locally from the replicated value.

    The tensor of ``src_data_rank`` is broadcast over every mesh axis (in place, as torch's
    Replicate does; ``None``: every rank's own), then this rank's share is copied out of it with
    no other temporary ([Note: no temporary beyond the share] in ``state_dict.py``): the box the
    other placements leave is a view, not a scattered copy. The local share is a fresh tensor,
    as torch's Shard gives (not a view of the full tensor, whose storage it would keep alive;
    and a DTensor over a view at a storage offset trips DCP's state-dict stager).
    """
    if device_mesh is None:
        raise ValueError("distribute_tensor with a RaggedShard placement needs device_mesh")
    axis, placement, xs = _check_placements(device_mesh, placements, tuple(tensor.shape))
    replicated = [Replicate()] * device_mesh.ndim
    full = compat.torch_distribute(
        tensor, device_mesh, replicated, src_data_rank=src_data_rank
    ).to_local()
    coordinate = device_mesh.get_local_rank(axis)
    local = torch.empty(
        placement.flat_range(xs, coordinate).numel, dtype=full.dtype, device=full.device
    )
    spec = DTensorSpec(
        device_mesh,
        tuple(placements),
        tensor_meta=TensorMeta(tensor.shape, _contiguous_stride(tensor.shape), tensor.dtype),
    )
    share_into(full.detach(), spec, local)
    return DTensor(  # type: ignore[no-untyped-call]
        local.requires_grad_(tensor.requires_grad), spec, requires_grad=tensor.requires_grad
    )


def _has_ragged(placements: Sequence[Placement] | None) -> bool:
    return placements is not None and any(isinstance(p, RaggedShard) for p in placements)


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> DTensor:
    """``torch.distributed.tensor.distribute_tensor``, also for RaggedShard placements.

    RaggedShard: the tensor of ``src_data_rank`` is broadcast like Replicate (``None``: every
    rank's own tensor is used), then each rank keeps its share (a copy). Other placements: torch's
    function, unchanged.
    """
    if not _has_ragged(placements):
        return compat.torch_distribute(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    assert placements is not None
    compat.ensure_installed()
    return distribute_ragged(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def check_ragged_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement],
    *,
    shape: Sequence[int] | None,
    stride: Sequence[int] | None,
    run_check: bool,
) -> tuple[torch.Tensor, torch.Size, tuple[int, ...]]:
    """Validate a ragged local tensor for ``from_local``; returns (flat local, shape, stride)."""
    if device_mesh is None:
        raise ValueError("from_local with a RaggedShard placement needs device_mesh")
    if shape is None:
        raise ValueError(
            "from_local with a RaggedShard placement needs shape=: the "
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
    if run_check:
        _check_ranks_agree(device_mesh, axis, placements, tuple(shape))
    return local_tensor.reshape(-1), torch.Size(shape), contiguous


def _check_ranks_agree(
    mesh: DeviceMesh, axis: int, placements: Sequence[Placement], shape: tuple[int, ...]
) -> None:
    """Every rank of the ragged axis must describe the same global tensor: compare (the common
    agreement check) and raise on all of them."""
    check_ranks_agree(
        mesh.get_group(axis),
        {"placements": repr(tuple(placements)), "global shape": repr(shape)},
        what=(
            f"from_local(run_check=True): ranks disagree on the ragged layout "
            f"(local_units, dims, shape) on mesh axis {axis}"
        ),
    )


def from_local(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    *,
    run_check: bool = False,
    shape: Sequence[int] | None = None,
    stride: Sequence[int] | None = None,
    grad_placements: Sequence[Placement] | None = None,
    requires_grad: bool | None = None,
) -> DTensor:
    """``DTensor.from_local``, also for RaggedShard placements (no communication unless
    ``run_check``).

    RaggedShard: ``shape=`` (the global shape) is required, ``stride=`` may be left out (it must
    be row-major); the local tensor must be this rank's contiguous share, of the size its units
    give (checked, flattened); ``shape=()`` makes a 0-d tensor (torch's ``from_local`` takes an
    empty shape for "not given"). ``run_check=True`` compares the layout across the ragged axis
    (``check_ranks_agree``), since torch's check compares local shapes, which legitimately
    differ. Differentiable like torch's. Other placements: torch's ``DTensor.from_local``,
    unchanged. ``requires_grad`` (not torch's): set it on the result.
    """
    if not _has_ragged(placements):
        dt = DTensor.from_local(
            local_tensor,
            device_mesh,
            placements,
            run_check=run_check,
            shape=None if shape is None else torch.Size(shape),
            stride=None if stride is None else tuple(stride),
            grad_placements=grad_placements,
        )
    else:
        assert placements is not None
        compat.ensure_installed()
        flat, size, contiguous = check_ragged_local(
            local_tensor, device_mesh, placements, shape=shape, stride=stride, run_check=run_check
        )
        assert device_mesh is not None
        if len(size) == 0:
            # torch's from_local would take shape=() for "not given" and infer a 1-d shape
            meta = TensorMeta(size, (), flat.dtype)
            spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta)
            dt = DTensor(flat, spec, requires_grad=flat.requires_grad)  # type: ignore[no-untyped-call]
        else:
            dt = DTensor.from_local(
                flat,
                device_mesh,
                placements,
                run_check=False,
                shape=size,
                stride=contiguous,
                grad_placements=grad_placements,
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
