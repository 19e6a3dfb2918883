"""Parameters that are already DTensors (tensor or expert parallel, or on the SPMD mesh of
``dp_mesh_dims``): what their unsharded and sharded DTensors are."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from fsdp_engine._private import compat
from ragged_dtensor import RaggedShard

if TYPE_CHECKING:
    from fsdp_engine._private.param import ParamRef
    from fsdp_engine._private.spmd import SpmdMesh

__all__ = ["TPSpec", "tp_spec"]


@attrs.frozen
class TPSpec:
    """A parameter that is already a DTensor (tensor/expert parallel, or on the full SPMD mesh
    of ``dp_mesh_dims``): what its unsharded and sharded DTensors are."""

    mesh: DeviceMesh  # the parameter's own mesh (e.g. "tp", or the SPMD mesh): the unsharded one's
    placements: tuple[Placement, ...]  # its own placements: the unsharded parameter's
    shape: torch.Size  # global shape
    stride: tuple[int, ...]
    spmd_mesh: DeviceMesh  # the sharded parameter's mesh
    # the sharded parameter's placements: an int k stands for the data-parallel placement k
    template: tuple[Placement | int, ...] = ()
    dp_dims: frozenset[int] = frozenset()  # the data-parallel dims of an SPMD mesh

    def sharded_placements(self, dp: Sequence[Placement]) -> tuple[Placement, ...]:
        """The sharded parameter's placements, given its placements on the data-parallel
        mesh (RaggedShard on the shard axis, Replicate on HSDP's replicate axis)."""
        return tuple(dp[t] if isinstance(t, int) else t for t in self.template)

    def target(self, grad: DTensor) -> tuple[Placement, ...]:
        """FSDP2's placements for the unsharded gradient before its reduction: the parameter's
        own, except on the data-parallel dims of an SPMD mesh, where the gradient keeps its own
        (a Partial there is what the reduction sums)."""
        return tuple(
            grad.placements[i] if i in self.dp_dims else p for i, p in enumerate(self.placements)
        )


def tp_spec(
    ref: ParamRef, param: torch.Tensor, dp_mesh: DeviceMesh, spmd: SpmdMesh | None = None
) -> TPSpec | None:
    """The tensor-parallel spec of a DTensor parameter (None for a plain tensor); refuses what
    the data-parallel sharding cannot hold, by name. With ``spmd`` (``dp_mesh_dims``) every
    parameter must be a DTensor on the SPMD mesh ([Note: SPMD meshes])."""
    if spmd is not None:
        mesh, template, dp_dims = spmd.spec(ref.fqn, ref.attr, param)
    if not isinstance(param, DTensor):
        return None
    if any(isinstance(p, RaggedShard) for p in param.placements):
        raise ValueError(
            f"parameter {ref.fqn!r} is already RaggedShard-sharded "
            f"({param.placements}); fully_shard it once"
        )
    if any(p.is_partial() for p in param.placements):
        raise ValueError(f"parameter {ref.fqn!r} has a Partial placement {param.placements}")
    if not param.to_local().is_contiguous():
        raise ValueError(f"parameter {ref.fqn!r}: its local shard is not contiguous")
    own = (param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()))
    if spmd is not None:
        return TPSpec(*own, mesh, template, dp_dims)
    try:
        spmd_mesh = compat.concatenate_meshes([dp_mesh, param.device_mesh])
    except Exception as exc:  # torch raises several types here
        raise ValueError(
            f"parameter {ref.fqn!r} lives on {param.device_mesh}, which does not "
            f"combine with the data-parallel mesh {dp_mesh} (both must be slices of "
            f"one parent mesh, e.g. mesh['dp'] and mesh['tp']): {exc}"
        ) from exc
    template = (*range(dp_mesh.ndim), *param.placements)
    return TPSpec(*own, spmd_mesh, template)
