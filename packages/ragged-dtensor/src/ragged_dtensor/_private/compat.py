"""The narrowly scoped hooks that let torch's own DTensor API accept RaggedShard (torch 2.13).

[Note: why hooks]
DTensor in torch 2.13 has no plug-in point for a new placement: redistribution is a hard-coded chain
of is_replicate/is_shard/is_partial checks, and a foreign placement passed through it *silently*
returns wrong data (Replicate -> X keeps the full tensor). So we wrap exactly these entry points,
each delegating to torch untouched unless a RaggedShard is involved:

1. ``redistribute_local_tensor`` (in the three modules that call it): ``DTensor.redistribute``,
   ``full_tensor``, autograd backward, and the input redistribution of op dispatch;
2. the sharding propagator: ops with a ragged operand get the rules of ``ops.py`` or an error;
3. ``distribute_tensor``: RaggedShard is cut from the (source-rank) full tensor;
4. ``DTensor.from_local``: ragged locals are checked against their units, ``shape=`` required
   (a 0-d ``shape=()``, which torch takes for "not given", is honoured);
5. the checkpoint protocol of DTensor (``__create_write_items__``, ``__create_chunk_list__``,
   ``__get_tensor_shard__``): a ragged share is written as the few boxes its flat range covers;
6. the Python slow path of op dispatch (``_dispatch_get_local_results_slow_path``, where torch
   runs random ops): a random op on a ragged operand draws what one device draws (random.py).

Each hook is installed once, checks that what it wraps still has the expected shape, and
``hooks_installed()`` lets a test fail loudly if torch changes underneath.
"""

from __future__ import annotations

import functools
import inspect
import math
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor._sharding_prop import LocalLRUCache
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private import checkpoint, ops
from ragged_dtensor._private import random as ragged_random
from ragged_dtensor._private.placement import RaggedBoxView, RaggedPaddedView, RaggedShard
from ragged_dtensor._private.redistribute import execute, plan_redistribute, ragged_axis, x_shape

__all__ = ["hooks_installed", "install", "ragged_redistribute_local"]

SUPPORTED_TORCH = ("2.13",)
_INSTALLED: dict[str, bool] = {}
_ORIGINAL_REDISTRIBUTE: Callable[..., torch.Tensor] = dtensor_redistribute.redistribute_local_tensor


def _spec_has_ragged(spec: DTensorSpec) -> bool:
    return any(isinstance(p, RaggedShard) for p in spec.placements)


def _torch_redistribute(
    mesh: DeviceMesh,
    meta: TensorMeta | None,
) -> Callable[[torch.Tensor, tuple[Placement, ...], tuple[Placement, ...]], torch.Tensor]:
    def run(
        local: torch.Tensor, before: tuple[Placement, ...], after: tuple[Placement, ...]
    ) -> torch.Tensor:
        src = DTensorSpec(mesh, before, tensor_meta=meta)
        dst = DTensorSpec(mesh, after, tensor_meta=meta)
        return _ORIGINAL_REDISTRIBUTE(local, src, dst)

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
    fill = placement.fill
    if not local.dtype.is_floating_point and math.isinf(fill):  # integers: their extremes
        info = torch.iinfo(local.dtype) if local.dtype != torch.bool else None
        fill = (info.max if fill > 0 else info.min) if info is not None else float(fill > 0)
    full = torch.full(xs, fill, dtype=local.dtype, device=local.device)
    full.view(-1)[flat.start : flat.stop] = local.reshape(-1)
    return full


def _redistribute_hook(
    local_tensor: torch.Tensor,
    current_spec: DTensorSpec,
    target_spec: DTensorSpec,
    *args: Any,
    **kwargs: Any,
) -> torch.Tensor:
    if any(isinstance(p, RaggedPaddedView) for p in target_spec.placements):
        return _padded_view(local_tensor, current_spec, target_spec)
    if any(isinstance(p, RaggedBoxView) for p in target_spec.placements):
        return _box_view(local_tensor, current_spec, target_spec)
    if _spec_has_ragged(current_spec) or _spec_has_ragged(target_spec):
        return ragged_redistribute_local(local_tensor, current_spec, target_spec)
    return _ORIGINAL_REDISTRIBUTE(local_tensor, current_spec, target_spec, *args, **kwargs)


def _install_redistribute() -> None:
    params = list(inspect.signature(_ORIGINAL_REDISTRIBUTE).parameters)
    if params[:3] != ["local_tensor", "current_spec", "target_spec"]:
        raise RuntimeError(
            f"ragged_dtensor: torch's redistribute_local_tensor changed "
            f"(parameters {params}); this torch version is not supported"
        )
    for module in (dtensor_redistribute, dtensor_dispatch, dtensor_api):
        if getattr(module, "redistribute_local_tensor", None) is not _ORIGINAL_REDISTRIBUTE:
            raise RuntimeError(
                f"ragged_dtensor: {module.__name__}.redistribute_local_tensor is "
                f"not torch's function any more; refusing to patch"
            )
        module.redistribute_local_tensor = _redistribute_hook  # type: ignore[attr-defined]
    _INSTALLED["redistribute"] = True


def _x_shape_of(spec: DTensorSpec) -> tuple[int, ...]:
    return x_shape(tuple(spec.shape), spec.mesh, spec.placements)


def _local_numel(spec: DTensorSpec) -> int:
    axis = ragged_axis(spec.placements)
    assert axis is not None
    return steps_expected_local(
        spec, x_shape(tuple(spec.shape), spec.mesh, spec.placements), spec.mesh, axis
    )


def _install_propagator() -> None:
    propagator = DTensor._op_dispatcher.sharding_propagator
    original = propagator.propagate_op_sharding_non_cached
    tensor_meta = propagator._propagate_tensor_meta_non_cached

    @functools.wraps(original)
    def propagate(op_schema: OpSchema) -> OutputSharding:
        if ops.schema_has_ragged(op_schema):
            return ops.propagate_ragged(op_schema, tensor_meta, _local_numel, _x_shape_of)
        return original(op_schema)

    propagator.propagate_op_sharding_non_cached = propagate  # type: ignore[method-assign]
    propagator.propagate_op_sharding = LocalLRUCache(propagate)
    _INSTALLED["propagator"] = True


_ORIGINAL_DISTRIBUTE = dtensor_api.distribute_tensor
# A private copy of torch's function: the public one gets our trampoline as its code object.
_TORCH_DISTRIBUTE = types.FunctionType(
    _ORIGINAL_DISTRIBUTE.__code__,
    _ORIGINAL_DISTRIBUTE.__globals__,
    "distribute_tensor",
    _ORIGINAL_DISTRIBUTE.__defaults__,
    _ORIGINAL_DISTRIBUTE.__closure__,
)
_TORCH_DISTRIBUTE.__kwdefaults__ = _ORIGINAL_DISTRIBUTE.__kwdefaults__


def _distribute_impl(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    src_data_rank: int | None,
) -> DTensor:
    if placements is None or not any(isinstance(p, RaggedShard) for p in placements):
        return _TORCH_DISTRIBUTE(  # type: ignore[no-any-return]
            tensor,
            device_mesh,
            placements,
            src_data_rank=src_data_rank,
        )
    from ragged_dtensor._private.api import distribute_ragged

    return distribute_ragged(
        tensor, device_mesh, placements, _TORCH_DISTRIBUTE, src_data_rank=src_data_rank
    )


def _distribute_trampoline(  # type: ignore[no-untyped-def]
    tensor, device_mesh=None, placements=None, *, src_data_rank=0
):
    # Runs as the code of torch's own distribute_tensor, so its globals are torch's _api module:
    # the name below is injected there by _install_distribute.
    return _ragged_distribute_impl(  # type: ignore[name-defined]  # noqa: F821
        tensor, device_mesh, placements, src_data_rank
    )


def _install_distribute() -> None:
    # [Note: swapping the code object]
    # Users (and torch itself) bind ``distribute_tensor`` by name at import time, often before
    # ragged_dtensor is imported, so rebinding module attributes would miss them. Swapping the
    # function's code object reaches every existing reference; the original code lives on in
    # _TORCH_DISTRIBUTE and runs untouched whenever no RaggedShard is involved.
    params = list(inspect.signature(_ORIGINAL_DISTRIBUTE).parameters)
    if params != ["tensor", "device_mesh", "placements", "src_data_rank"] or (
        _ORIGINAL_DISTRIBUTE.__code__.co_freevars
    ):
        raise RuntimeError(
            f"ragged_dtensor: torch's distribute_tensor changed (parameters "
            f"{params}); this torch version is not supported"
        )
    dtensor_api.__dict__["_ragged_distribute_impl"] = _distribute_impl
    _ORIGINAL_DISTRIBUTE.__code__ = _distribute_trampoline.__code__
    _INSTALLED["distribute_tensor"] = True


_ORIGINAL_FROM_LOCAL = DTensor.from_local


def _from_local_hook(
    local_tensor: torch.Tensor,
    device_mesh: DeviceMesh | None = None,
    placements: Sequence[Placement] | None = None,
    **kwargs: Any,
) -> DTensor:
    if placements is not None and any(isinstance(p, RaggedShard) for p in placements):
        from ragged_dtensor._private.api import check_ragged_local

        local_tensor, kwargs = check_ragged_local(local_tensor, device_mesh, placements, **kwargs)
        if len(kwargs["shape"]) == 0:
            # torch's from_local takes an empty ``shape=`` for "not given" and then cannot infer a
            # ragged global shape: a 0-d ragged DTensor gets its spec built here
            assert device_mesh is not None
            meta = TensorMeta(torch.Size(()), (), local_tensor.dtype)
            spec = DTensorSpec(device_mesh, tuple(placements), tensor_meta=meta)
            return DTensor(local_tensor, spec, requires_grad=local_tensor.requires_grad)  # type: ignore[no-untyped-call]
    return _ORIGINAL_FROM_LOCAL(local_tensor, device_mesh, placements, **kwargs)


def _install_from_local() -> None:
    DTensor.from_local = staticmethod(_from_local_hook)  # type: ignore[method-assign]
    _INSTALLED["from_local"] = True


def _install_checkpoint() -> None:
    for name in ("__create_write_items__", "__create_chunk_list__", "__get_tensor_shard__"):
        if not hasattr(DTensor, name):
            raise RuntimeError(
                f"ragged_dtensor: DTensor.{name} is gone; checkpoint hooks cannot "
                f"be installed on this torch version"
            )
    checkpoint.install(DTensor)
    _INSTALLED["checkpoint"] = True


def _cut_share(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's share of a full-shape tensor laid out as ``spec`` (no communication)."""
    from ragged_dtensor._private.api import distribute_ragged

    placed = distribute_ragged(
        full, spec.mesh, spec.placements, _TORCH_DISTRIBUTE, src_data_rank=None
    )
    return placed.to_local()


def _install_random() -> None:
    dispatcher = DTensor._op_dispatcher
    original = getattr(dispatcher, "_dispatch_get_local_results_slow_path", None)
    if original is None or list(inspect.signature(original).parameters) != [
        "op_call",
        "args",
        "op_info",
    ]:
        raise RuntimeError(
            "ragged_dtensor: DTensor's _dispatch_get_local_results_slow_path changed; "
            "this torch version is not supported"
        )
    random_ops = dispatcher._random_ops

    def slow_path(op_call: torch._ops.OpOverload, args: tuple[object, ...], op_info: Any) -> Any:
        random = op_call in random_ops or op_call in ops.RANDOM_OPS
        if random and ragged_random.is_ragged_random(op_call, args):
            return ragged_random.ragged_random_op(op_call, args, op_info, _cut_share)
        return original(op_call, args, op_info)

    setattr(dispatcher, "_dispatch_get_local_results_slow_path", slow_path)  # noqa: B010
    _INSTALLED["random"] = True


def install() -> None:
    """Install every hook once (idempotent). Called when ``ragged_dtensor`` is imported."""
    if _INSTALLED:
        return
    if not torch.__version__.startswith(SUPPORTED_TORCH):
        raise ImportError(
            f"ragged_dtensor supports torch {SUPPORTED_TORCH}; found {torch.__version__}"
        )
    _install_redistribute()
    _install_propagator()
    _install_distribute()
    _install_from_local()
    _install_checkpoint()
    _install_random()


def hooks_installed() -> dict[str, bool]:
    """Which hooks are in place (tests assert all of them)."""
    return dict(_INSTALLED)
