"""Per-parameter meshes: ``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult``.

[Note: per-parameter meshes]
FSDP2 lets ``shard_placement_fn`` put a parameter on a mesh of its own with
``ShardPlacementResult(placement, mesh_info)``: MoE experts sharded over the data-parallel ranks
of their expert-parallel group while the dense layers use the whole data-parallel mesh. One
``fully_shard`` call then makes one group per process group (FSDP2's ``_init_param_group``).
Ours the same: a call's parameters are split by mesh first (in order of first appearance), then
by dtype and layout (planned, or FSDP2's placed ``Shard(d)``: [Note: placed groups]); each group
lives on its own mesh, so its collectives run on that mesh's process groups and its DTensors
are on it. ``placement=None`` means our planned layout on that mesh (FSDP2: ``Shard(0)``).

The mesh info is FSDP2's: ``FSDPMeshInfo`` with a 1-D mesh (FSDP), ``HSDPMeshInfo`` with a 2-D
mesh that replicates on axis 0 and shards on axis 1 (HSDP, as the ``mesh`` argument). Other
arrangements, replicate-only infos (``DDPMeshInfo``) and SPMD infos (``dp_mesh_dims``) are
refused by name. Parameters on meshes that are the same process groups share a group, as in
FSDP2, whichever ``DeviceMesh`` object names them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from fsdp_engine._private import compat_fsdp2
from fsdp_engine._private.param import ParamRef

__all__ = ["by_mesh", "split_placement"]


def split_placement(result: Any, fqn: str) -> tuple[Any, DeviceMesh | None]:
    """A ``shard_placement_fn`` result as (placement, mesh): the mesh is None for the call's own
    mesh. A ``ShardPlacementResult``'s mesh info becomes the mesh our groups use."""
    cls = compat_fsdp2.shard_placement_result_type()
    if cls is None or not isinstance(result, cls):
        return result, None
    placement = getattr(result, "placement", None)
    if placement is not None and not isinstance(placement, Shard):
        raise ValueError(f"Invalid shard_placement_fn result: {result}")
    return placement, _mesh_of(getattr(result, "mesh_info", None), fqn)


def _mesh_of(info: Any, fqn: str) -> DeviceMesh:
    mesh = getattr(info, "mesh", None)
    if not isinstance(mesh, DeviceMesh):
        raise ValueError(
            f"shard_placement_fn returned a ShardPlacementResult without a DeviceMesh for "
            f"parameter {fqn!r}: {info!r}"
        )
    if getattr(info, "dp_mesh_dims", None) is not None:
        raise NotImplementedError(
            f"shard_placement_fn put parameter {fqn!r} on an SPMD mesh info (dp_mesh_dims): "
            "per-parameter meshes are supported as FSDPMeshInfo (1-D) or HSDPMeshInfo (2-D)"
        )
    shard = getattr(info, "shard_mesh_dim", None)
    replicate = getattr(info, "replicate_mesh_dim", None)
    if shard is None:
        raise NotImplementedError(
            f"shard_placement_fn put parameter {fqn!r} on a replicate-only mesh info "
            f"({type(info).__name__}): fsdp_engine shards every parameter of fully_shard"
        )
    if replicate is None and mesh.ndim == 1:
        return mesh
    if replicate == 0 and shard == 1 and mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
        return mesh
    raise NotImplementedError(
        f"shard_placement_fn put parameter {fqn!r} on a {mesh.ndim}-D mesh with "
        f"shard_mesh_dim={shard}, replicate_mesh_dim={replicate}: per-parameter meshes are "
        "1-D (FSDPMeshInfo) or 2-D replicating on dim 0 and sharding on dim 1 (HSDPMeshInfo)"
    )


def by_mesh(
    refs: Sequence[ParamRef], meshes: dict[str, DeviceMesh], default: DeviceMesh
) -> list[tuple[DeviceMesh, list[ParamRef]]]:
    """The call's parameters by mesh, in order of first appearance; meshes over the same
    process groups are one (FSDP2 keys its groups by them)."""
    out: dict[tuple[int, ...], tuple[DeviceMesh, list[ParamRef]]] = {}
    for ref in refs:
        mesh = meshes.get(ref.fqn, default)
        key = tuple(id(mesh.get_group(axis)) for axis in range(mesh.ndim))
        out.setdefault(key, (mesh, []))[1].append(ref)
    return list(out.values())
