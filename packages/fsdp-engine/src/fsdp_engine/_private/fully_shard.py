"""``fully_shard``: FSDP2's function, our machinery (its ``_fully_shard``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, overload

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_engine._private.api import (
    BlockPolicy,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fsdp_engine._private.applied import check_modules
from fsdp_engine._private.compat import mark_fully_sharded
from fsdp_engine._private.compat_fsdp2 import register_torch_state
from fsdp_engine._private.fsdp_module import FSDPModule
from fsdp_engine._private.init import (
    by_dtype,
    check_mp_policy,
    check_offload_policy,
    check_param,
    check_ranks_agree_on_call,
    default_mesh,
    managed_params,
    parse_reshard_after_forward,
    remember,
    resolve_device,
    with_placement_fn,
    with_subclass_placement,
)
from fsdp_engine._private.one_engine import check_not_under_torch
from fsdp_engine._private.param import ParamRef
from fsdp_engine._private.param_group import ParamGroup
from fsdp_engine._private.param_meshes import by_mesh
from fsdp_engine._private.replaced import watch_replaced
from fsdp_engine._private.serialization import allow_raggedshard_in_weights_only_load
from fsdp_engine._private.spmd import SpmdMesh, spmd_mesh, validate_dp_mesh_dims
from fsdp_engine._private.state import STATE_ATTR, FSDPState, get_state
from shard_planner import METHODS as PLANNER_METHODS

__all__ = ["fully_shard"]

_CLASS_CACHE: dict[type, type] = {}


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    block_policy: BlockPolicy | None = ...,
    planner: str = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
    block_policy: BlockPolicy | None = ...,
    planner: str = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen value
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen value
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
    block_policy: BlockPolicy | None = None,
    planner: str = "auto",
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh`` (FSDP2's signature and behaviour).

    One call makes one group per parameter dtype: its parameters are planned into one flat
    buffer (no block of ``block_policy`` cut by a shard boundary), held as ``RaggedShard`` DTensor
    views, all-gathered with one collective before forward (and backward) and reduce-scattered
    with one collective after backward. ``mesh``: 1-D (FSDP) or 2-D (HSDP: axis 0 replicates,
    axis 1 shards). ``reshard_after_forward``: ``None`` (default) reshards after forward except
    for the root, which keeps its parameters for the start of backward; ``True``/``False``; or an
    int k dividing the shard-axis size: ``1`` is ``False``, the axis size is ``True``, any other k
    keeps 1/k of the unsharded buffer and re-gathers within groups of k ranks. ``planner``: the
    ``shard_planner.plan`` method (``"auto"``; ``"naive"`` concatenates, for ablations).
    ``dp_mesh_dims``: ``mesh`` is the full SPMD mesh, every parameter a DTensor on it, and the
    named dims are the data-parallel ones (FSDP2's rules: [Note: SPMD meshes]).
    """
    if planner not in PLANNER_METHODS:
        raise ValueError(f"fully_shard: planner must be one of {PLANNER_METHODS}, got {planner!r}")
    modules = module if isinstance(module, list) else [module]
    check_modules(modules)
    check_not_under_torch(modules)  # [Note: one engine per model]
    allow_raggedshard_in_weights_only_load()  # [Note: the per-rank save]
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    mp_policy = check_mp_policy(mp_policy)
    offload_policy = check_offload_policy(offload_policy)
    mesh = mesh or default_mesh()
    spmd: SpmdMesh | None = None
    if dp_mesh_dims is not None:  # [Note: SPMD meshes]
        validate_dp_mesh_dims(mesh, dp_mesh_dims)
        spmd = spmd_mesh(mesh, dp_mesh_dims)
        if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise NotImplementedError(
                "reshard_after_forward as int is not yet supported with SPMD mesh (dp_mesh_dims)"
            )
        mesh = spmd.dp_mesh
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    shard_axis = mesh.ndim - 1
    world = mesh.size(shard_axis)
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError("CPUOffloadPolicy on an accelerator mesh is not supported yet")
    reshard, subgroup = parse_reshard_after_forward(reshard_after_forward, world)
    refs = managed_params(modules, set(ignored_params or ()))
    for ref in refs:
        check_param(ref)
    user_block_policy = block_policy  # also recorded on the planned groups' parameters
    block_policy, shard_dims, meshes = with_placement_fn(
        block_policy, shard_placement_fn, refs, world
    )
    if meshes and (subgroup or spmd is not None):
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn put {sorted(meshes)} on meshes of their own "
            "([Note: per-parameter meshes]); not supported together with "
            + ("reshard_after_forward as an int" if subgroup else "dp_mesh_dims")
        )
    shard_dims = with_subclass_placement(refs, shard_dims, user_block_policy)
    check_ranks_agree_on_call(
        mesh if spmd is None else spmd.mesh,
        {
            "module": ",".join(type(m).__name__ for m in modules),
            "reshard_after_forward": repr(reshard_after_forward),
            "mp_policy": repr(mp_policy),
            "offload_policy": repr(offload_policy),
            "block_policy": "none" if block_policy is None else type(block_policy).__name__,
            # the groups follow it: a rank-dependent shard_placement_fn is named, not a hang
            "shard_placement_fn": repr(sorted(shard_dims.items())),
            # the shape only: ranks of different sub-meshes name different ranks
            "parameter meshes": repr(sorted((n, tuple(m.shape)) for n, m in meshes.items())),
        },
        refs,
    )
    originals = [(ref.registered(), ref.fqn) for ref in refs]
    for original, fqn in originals:
        remember(original, fqn)
    device = resolve_device(refs, mesh)

    def group(on: DeviceMesh, members: list[ParamRef], dims: list[int] | None) -> ParamGroup:
        return ParamGroup(
            members,
            on,
            mp_policy=mp_policy,
            block_policy=block_policy if dims is None else None,
            shard_axis=on.ndim - 1,
            device=device,
            planner=planner,
            shard_dims=dims,
            post_forward_k=subgroup,
            spmd=spmd,
        )

    groups: list[ParamGroup] = []
    for on, members in by_mesh(refs, meshes, mesh):  # [Note: per-parameter meshes]
        planned = [r for r in members if r.fqn not in shard_dims]
        placed = [r for r in members if r.fqn in shard_dims]
        planned_groups = [group(on, m, None) for m in by_dtype(planned)]
        for planned_group in planned_groups:  # [Note: the recorded block policy] (param.py)
            for param in planned_group.params:
                param.record_block_policy(user_block_policy)
        groups += planned_groups
        # [Note: placed groups]: the Shard(d)-placed parameters of a dtype share one group
        groups += [group(on, m, [shard_dims[r.fqn] for r in m]) for m in by_dtype(placed)]
    state = FSDPState(modules, groups, reshard_after_forward=reshard, mp_policy=mp_policy)
    watch_replaced(state, originals)  # [Note: an optimizer built before fully_shard]
    results: list[FSDPModule] = []
    for target in modules:
        target.__dict__[STATE_ATTR] = state
        mark_fully_sharded(target)
        register_torch_state(target, state)  # [Note: pipeline stages] (pipelining)
        cls = type(target)
        new_cls = _CLASS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLASS_CACHE[cls] = new_cls
        target.__class__ = new_cls
        assert isinstance(target, FSDPModule)
        results.append(target)
    # FSDP2 returns its argument: the module, or the very list it was given
    return module if isinstance(module, list) else results[0]  # type: ignore[return-value]


# FSDP2's ``fully_shard.state(module)``: the state a call attached to the module (ours), or None
fully_shard.state = get_state  # type: ignore[attr-defined]
