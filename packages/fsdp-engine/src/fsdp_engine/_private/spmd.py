"""``fully_shard(module, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(...))``: parameters
that are already DTensors on the full SPMD mesh, the data-parallel axes named (torch 2.13's path,
torchtitan's full-DTensor backend).

[Note: SPMD meshes]
FSDP2's rules (``_fsdp_init.py``, ``_fsdp_param.py``), each with its exception and message:
the named dims must exist; every managed parameter must be a DTensor on exactly that mesh
object, ``Replicate()`` on every data-parallel dim. Several shard (or replicate) names are
flattened into one axis. The group then shards on the data-parallel mesh (the shard axis, or
``(replicate, shard)`` for HSDP) exactly as for a plain mesh; what changes is the DTensors:

- the sharded parameter lives on the SPMD mesh (its placements the original ones with our
  ``RaggedShard`` on the shard dim; with several shard names, FSDP2's mesh of the flattened
  data-parallel axis next to the other dims);
- the unsharded parameter is the original DTensor again (SPMD mesh, original placements,
  ``Replicate()`` on the data-parallel dims), so the model's DTensor code runs unchanged;
- its gradient keeps its data-parallel placements (a ``Partial`` there is what the reduction
  sums) and is redistributed to the original placements on the other dims before the
  reduction, FSDP2's ``_get_grad_inner_tensor``.

FSDP2's DDP mode (replicate names only) is not supported: a group always shards.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Placement

from fsdp_engine._private import compat

__all__ = ["SpmdMesh", "spmd_mesh", "validate_dp_mesh_dims"]


def _names(value: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def validate_dp_mesh_dims(mesh: DeviceMesh, dims: Any) -> None:
    """FSDP2's ``_validate_mesh`` for ``dp_mesh_dims`` (its errors and messages)."""
    if not (hasattr(dims, "shard") and hasattr(dims, "replicate")):
        raise TypeError(
            f"fully_shard: dp_mesh_dims must be a DataParallelMeshDims (fields shard, "
            f"replicate), got {type(dims).__name__}"
        )
    if dims.shard is None and dims.replicate is None:
        raise ValueError("At least one of shard or replicate must be set in dp_mesh_dims")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh must have mesh_dim_names when dp_mesh_dims is provided")
    for name in (*_names(dims.shard), *_names(dims.replicate)):
        if name not in mesh.mesh_dim_names:
            raise ValueError(
                f"Mesh dim name '{name}' not found in mesh.mesh_dim_names {mesh.mesh_dim_names}"
            )


@attrs.frozen
class SpmdMesh:
    """A full SPMD mesh and its data-parallel dims (module Note)."""

    mesh: DeviceMesh
    dp_mesh: DeviceMesh  # 1-D shard axis, or (replicate, shard) for HSDP
    shard_names: tuple[str, ...]
    replicate_names: tuple[str, ...]

    def _index(self, name: str) -> int:
        names = self.mesh.mesh_dim_names
        assert names is not None
        return names.index(name)

    def spec(
        self, fqn: str, attr: str, param: torch.Tensor
    ) -> tuple[DeviceMesh, tuple[Any, ...], frozenset[int]]:
        """The sharded DTensor's mesh and placement template of parameter ``fqn`` (an int ``k``
        stands for the data-parallel mesh's placement ``k``), and the data-parallel dims of
        the SPMD mesh; FSDP2's checks first."""
        if not isinstance(param, DTensor):
            raise ValueError(
                "When dp_mesh_dims is provided, all parameters must be "
                "DTensors on the full SPMD mesh (e.g. via distribute_module). "
                f"Got plain tensor for parameter '{attr}'."
            )
        mesh = param.device_mesh
        if mesh is not self.mesh:
            raise ValueError(
                "Expected param's DTensor mesh to be the same mesh passed "
                "to fully_shard, but got different mesh objects"
            )
        names = mesh.mesh_dim_names
        assert names is not None
        placements = tuple(param.placements)
        for kind, group in (("shard", self.shard_names), ("replicate", self.replicate_names)):
            for name in group:
                idx = self._index(name)
                if not isinstance(placements[idx], Replicate):
                    raise ValueError(
                        f"Expected Replicate() on DP {kind} dim '{names[idx]}' (index {idx}) "
                        f"but got {placements[idx]}"
                    )
        dp_dims = frozenset(self._index(n) for n in (*self.shard_names, *self.replicate_names))
        hsdp = bool(self.replicate_names)
        shard_slot = 1 if hsdp else 0
        if len(self.shard_names) == 1:
            template: list[Placement | int] = list(placements)
            template[self._index(self.shard_names[0])] = shard_slot
            return mesh, tuple(template), dp_dims
        # several shard dims: FSDP2's mesh, the data-parallel mesh where the first shard dim
        # was, the replicate dims (HSDP) folded into it, the other dims as they are
        submeshes: list[DeviceMesh] = []
        template = []
        for i, name in enumerate(names):
            if name in self.shard_names:
                if name == self.shard_names[0]:
                    submeshes.append(self.dp_mesh)
                    template.extend([0, 1] if hsdp else [0])
                continue
            if name in self.replicate_names:
                continue
            submeshes.append(mesh[name])
            template.append(placements[i])
        return compat.concatenate_meshes(submeshes), tuple(template), dp_dims


def spmd_mesh(mesh: DeviceMesh, dims: Any) -> SpmdMesh:
    """FSDP2's ``_get_mesh_info_from_named_dims``: the data-parallel mesh of ``dims``."""
    shard, replicate = _names(dims.shard), _names(dims.replicate)
    if not shard:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims=DataParallelMeshDims(replicate={dims.replicate!r})) "
            "without shard dims (FSDP2's DDP mode): fsdp_engine always shards; name the "
            "data-parallel dims to shard on with shard=..."
        )

    def submesh(names: tuple[str, ...]) -> DeviceMesh:
        if len(names) == 1:
            return mesh[names[0]]
        return compat.flatten_mesh(mesh[names], "_".join(names))

    dp = submesh(shard)
    if replicate:
        dp = compat.concatenate_meshes([submesh(replicate), dp])
    return SpmdMesh(mesh, dp, shard, replicate)
