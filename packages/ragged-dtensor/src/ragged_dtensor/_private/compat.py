"""The DTensor integration: the only module that changes torch's objects (torch 2.13.x).

[Note: nothing at import]
Importing ``ragged_dtensor`` (or a package built on it) changes nothing in torch. The integration
is installed when the first ``RaggedShard`` is constructed (``ensure_installed``, called by the
placement), or explicitly (``install_dtensor_integration``), and
``uninstall_dtensor_integration`` puts back the very objects it found.
Everything below is process-wide while installed, and nothing else in the package assigns to a
torch module, class or instance.

[Note: what is patched, and why each has no public route]
DTensor in torch 2.13 has no plug-in point for a new placement: redistribution is a hard-coded chain
of is_replicate/is_shard/is_partial checks, and a foreign placement passed through it *silently*
returns wrong data (Replicate -> X keeps the full tensor). So exactly these entry points are
wrapped, each delegating to torch's own function unless a RaggedShard is involved:

1. ``redistribute_local_tensor``, bound by name in the three modules that call it
   (``_redistribute``, ``_dispatch``, ``_api``): ``DTensor.redistribute``, ``full_tensor``,
   autograd backward and the input redistribution of op dispatch. No extension point.
2. the sharding propagator of DTensor's op dispatcher (``propagate_op_sharding_non_cached`` and
   its per-thread cache ``propagate_op_sharding``, instance attributes): ops with a ragged operand
   get the rules of ``ops.py`` or an error. Registering per-op strategies is public-ish, but a
   strategy cannot describe a placement that is not Shard/Replicate/Partial.
3. the Python slow path of op dispatch (``_dispatch_get_local_results_slow_path``, an instance
   attribute of the dispatcher), where torch runs random ops: a random op on a ragged operand
   draws what one device draws (random.py). DTensor's RNG tracker is not pluggable.
4. DTensor's checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
   ``__get_tensor_shard__``): a ragged share is written as the few boxes its flat range covers
   (checkpoint.py). See [Note: why the checkpoint protocol stays on the class].

5. ``distribute_tensor``'s code object ([Note: distribute_tensor's code]): torch's own function
   cuts a RaggedShard share from the (source rank's) full tensor. No extension point: a placement
   that is not Shard/Replicate/Partial raises "unsupported placements".

[Note: a DTensor's data_ptr]
torch builds a DTensor's wrapper with its local tensor's ``storage_offset`` over a null storage,
so a DTensor over a view that starts at an offset reports ``data_ptr() == offset * itemsize``,
and torch's copying code (``Tensor.__deepcopy__``, ``Tensor.__reduce_ex__``, DCP's stager) reads
a non-zero value as "copy this tensor's storage" and fails ("invalid python storage"). Earlier
versions made every DTensor report 0 (``DTensor.data_ptr`` patched process-wide, FSDP2's and
everybody's). Nothing is patched now: a flat-buffer FSDP hands out local tensors over storage of
their own (``own_storage_view``, [Note: views over storage of their own] in views.py), at offset
0, so its DTensors report 0 as FSDP2's do, and every other DTensor behaves as torch makes it.

7. ``torch.distributed._state_dict_utils._distribute_tensors`` (module attribute; its only caller
   looks it up by name): the full-state-dict load with ``broadcast_from_rank0=True`` cuts each
   rank's share there as a box of the full tensor, which a flat share is not (state_dict.py,
   [Note: why torch's state-dict loader needs a hook]). No placement hook is consulted.

``DTensor.from_local`` is *not* patched: ``ragged_dtensor.from_local`` checks a ragged share;
torch's builds the DTensor unchecked when given ``shape=`` and ``stride=``.

[Note: distribute_tensor's code]
``distribute_tensor(full, param.device_mesh, param.placements)`` is how FSDP2 users load full
weights into sharded parameters and how parity checks compare them (torch's own FSDP2 tests do),
and they bind the name at import, long before a RaggedShard exists: rebinding module attributes
would miss them. So the function object keeps its identity and gets a trampoline as its code
object while the integration is installed; the trampoline runs ``ragged_dtensor``'s cut for a
RaggedShard and a private copy of torch's code (made at import, a read) for anything else. The
original code object is put back by ``uninstall_dtensor_integration``.

[Note: why the checkpoint protocol stays on the class]
DTensor hands the three checkpoint methods to its local tensor when the local tensor defines
them (torch's ``LocalShardsWrapper`` does this). That route needs every ragged DTensor's local
tensor to be of our type, and in torch 2.13 it cannot be: op dispatch (C++) wraps each op's
output around a plain ``torch.Tensor``, whatever the type of the inputs' local tensors
(``test_ragged_import_side_effects.py`` pins this), so ``torch.zeros_like(param)`` (optimizer
state), ``param.detach()`` or a redistribution would lose the protocol, and DCP would then write
a flat share as if it were the whole tensor. DCP's planners are public, but a planner is chosen
by each caller of ``dcp.save``/``dcp.load``/``async_save`` (FSDP2 code passes none), so ragged
state dicts would need a different call than FSDP2's. So the three methods are wrapped on the
class, like the hooks above: checked, reversible, delegating to torch for every other DTensor.

[Note: checks]
Before changing anything, ``install_dtensor_integration`` checks the torch version (2.13.x) and
that each target is torch's own function (defined in torch's source file under the expected module
and name, not a wrapper, with the expected parameters) or, for the propagator's cache, torch's own
cache of torch's own method. If any check fails, it raises ``DTensorIntegrationError`` naming the
target and changes nothing. ``uninstall_dtensor_integration`` first checks that our wrappers are
still in place (nobody wrapped them since), else it raises and changes nothing.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed import _state_dict_utils as state_dict_utils
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor import _dispatch as dtensor_dispatch
from torch.distributed.tensor import _redistribute as dtensor_redistribute
from torch.distributed.tensor import _sharding_prop as dtensor_sharding_prop
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private import checkpoint, handlers, ops
from ragged_dtensor._private import debug as ragged_debug
from ragged_dtensor._private import random as ragged_random
from ragged_dtensor._private import state_dict as ragged_state_dict
from ragged_dtensor._private.fallback import (
    FallbackSpec,
    check_fallback,
    needs_write_back,
    write_back,
)
from ragged_dtensor._private.partial import FILL_OPS, fill_on_partial, inplace_on_partial
from ragged_dtensor._private.placement import (
    RaggedBoxView,
    RaggedBroadcastView,
    RaggedNonEmptyView,
    RaggedPaddedView,
    RaggedShard,
)
from ragged_dtensor._private.redistribute import execute, plan_redistribute, ragged_axis, x_shape
from ragged_dtensor._private.rows import flatten_outputs

__all__ = [
    "SUPPORTED_TORCH",
    "DTensorIntegrationError",
    "dtensor_integration",
    "dtensor_integration_installed",
    "ensure_installed",
    "hooks_installed",
    "install_dtensor_integration",
    "ragged_redistribute_local",
    "torch_distribute",
    "uninstall_dtensor_integration",
]

SUPPORTED_TORCH = (2, 13)
_TORCH_DISTRIBUTE = dtensor_api.distribute_tensor  # the object everyone bound
_TORCH_DISTRIBUTE_CODE = _TORCH_DISTRIBUTE.__code__
# torch's distribute_tensor as it is at import, callable while the public one runs ours
torch_distribute: Callable[..., DTensor] = types.FunctionType(
    _TORCH_DISTRIBUTE_CODE,
    _TORCH_DISTRIBUTE.__globals__,
    "distribute_tensor",
    _TORCH_DISTRIBUTE.__defaults__,
    _TORCH_DISTRIBUTE.__closure__,
)
torch_distribute.__kwdefaults__ = _TORCH_DISTRIBUTE.__kwdefaults__
_IMPL_NAME = "_ragged_dtensor_distribute"  # injected into torch's _api namespace while installed
_TORCH_ROOT = str(Path(torch.__file__).resolve().parent)
_CHECKPOINT_METHODS = {
    "__create_write_items__": ("self", "fqn", "object"),
    "__create_chunk_list__": ("self",),
    "__get_tensor_shard__": ("self", "index"),
}
_LAYOUT_FORMATS = (torch.channels_last, torch.channels_last_3d)
_REDISTRIBUTE_MODULES = (dtensor_redistribute, dtensor_dispatch, dtensor_api)


class DTensorIntegrationError(RuntimeError):
    """The DTensor integration cannot be installed or removed: the torch version is not supported,
    or a function it wraps is not the one torch ships (the message names it)."""


# -- the hooks ---------------------------------------------------------------------------------


@attrs.frozen
class _Originals:
    """torch's objects, checked and captured by ``install`` (the hooks call these)."""

    redistribute: Callable[..., torch.Tensor]
    propagate: Callable[[OpSchema], OutputSharding]
    tensor_meta: Callable[[OpSchema], Any]
    slow_path: Callable[..., Any]
    distribute_tensors: Callable[..., None]


_ORIGINALS: _Originals | None = None


def _torch_functions() -> _Originals:
    if _ORIGINALS is None:
        raise DTensorIntegrationError(
            "ragged_dtensor: a ragged DTensor is used while the DTensor integration is not "
            "installed; construct a RaggedShard or call install_dtensor_integration() first"
        )
    return _ORIGINALS


def _spec_has_ragged(spec: DTensorSpec) -> bool:
    return any(isinstance(p, RaggedShard) for p in spec.placements)


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


def _propagate_hook(op_schema: OpSchema) -> OutputSharding:
    originals = _torch_functions()
    if ops.schema_has_ragged(op_schema):
        return ops.propagate_ragged(
            op_schema, originals.tensor_meta, _local_numel, _x_shape_of, originals.propagate
        )
    if op_schema.op in FILL_OPS:  # [Note: a fill never stays Partial]
        filled = fill_on_partial(op_schema, originals.tensor_meta)
        if filled is not None:
            return filled
    try:
        return originals.propagate(op_schema)
    except RuntimeError:
        reduced = inplace_on_partial(op_schema, originals.propagate)
        if reduced is None:
            raise
        return reduced


def _cut_share(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's share of a full-shape tensor laid out as ``spec`` (no communication)."""
    from ragged_dtensor._private.api import distribute_ragged

    placed = distribute_ragged(full, spec.mesh, spec.placements, src_data_rank=None)
    return placed.to_local()


def _slow_path_hook(op_call: torch._ops.OpOverload, args: tuple[object, ...], op_info: Any) -> Any:
    originals = _torch_functions()
    if op_info.local_kwargs.get("memory_format") in _LAYOUT_FORMATS:
        ops.ragged_memory_format(args, op_info)
    random = op_call in DTensor._op_dispatcher._random_ops or op_call in ops.RANDOM_OPS
    if random and ragged_random.is_ragged_random(op_call, args):
        return ragged_random.ragged_random_op(op_call, args, op_info, _cut_share)
    result = originals.slow_path(op_call, args, op_info)
    sharding = op_info.output_sharding
    if getattr(sharding, "_ragged_flatten", False):  # a row rule's boxes: flat shares
        return flatten_outputs(result, sharding)
    if needs_write_back(sharding):  # an in-place op's fallback
        write_back(args, op_info, _cut_share)
    return result


def _distribute_tensors_hook(
    local_state_dict: dict[str, Any], keys: list[str], device: torch.device, pg: Any = None
) -> None:
    ragged_state_dict.distribute_tensors_hook(
        _torch_functions().distribute_tensors, local_state_dict, keys, device, pg
    )


def _checkpoint_hook(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    table: dict[str, Callable[..., Any]] = {
        "__create_write_items__": checkpoint.create_write_items,
        "__create_chunk_list__": checkpoint.create_chunk_list,
        "__get_tensor_shard__": checkpoint.get_tensor_shard,
    }
    ragged = table[name]

    @functools.wraps(original)
    def method(self: DTensor, *args: Any) -> Any:
        if _spec_has_ragged(self._spec):
            return ragged(self, *args)
        return original(self, *args)

    return method


# -- checks ------------------------------------------------------------------------------------


_REFUSING = "Refusing to install the DTensor integration (nothing was changed)."


def _describe(value: object) -> str:
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    where = f" (defined in {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{value!r}{where}"


def _expect_torch_function(
    value: object, where: str, module: str, qualname: str, parameters: Sequence[str]
) -> Callable[..., Any]:
    """``value`` if it is torch's own ``module.qualname`` with these leading parameters, else
    raise naming ``where`` (the attribute that holds it)."""
    fn = value.__func__ if isinstance(value, types.MethodType) else value
    if not (
        isinstance(fn, types.FunctionType)
        and fn.__module__ == module
        and fn.__qualname__ == qualname
        and not hasattr(fn, "__wrapped__")
        and str(Path(fn.__code__.co_filename).resolve()).startswith(_TORCH_ROOT)
    ):
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not torch's {module}.{qualname} but "
            f"{_describe(value)}; another library may have replaced or wrapped it. {_REFUSING}"
        )
    found = list(inspect.signature(fn).parameters)
    if found[: len(parameters)] != list(parameters):
        raise DTensorIntegrationError(
            f"ragged_dtensor: torch's {module}.{qualname} ({where}) takes parameters {found}, "
            f"expected {list(parameters)} first; this torch build is not supported. {_REFUSING}"
        )
    return fn


def _expect_not_on_instance(owner: object, name: str, where: str) -> None:
    """torch defines ``name`` on the class; an instance attribute is someone else's."""
    if name in vars(owner):
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not torch's method but "
            f"{_describe(vars(owner)[name])}, set on the instance by another library. "
            f"{_REFUSING}"
        )


def _check_version() -> None:
    release = torch.__version__.split("+")[0].split(".")
    if tuple(int(x) for x in release[:2] if x.isdigit()) != SUPPORTED_TORCH:
        raise DTensorIntegrationError(
            f"ragged_dtensor's DTensor integration supports torch "
            f"{'.'.join(map(str, SUPPORTED_TORCH))}.x; found torch {torch.__version__}"
        )


@attrs.frozen
class _Change:
    """One attribute the integration sets: where, the value found (``None`` with ``own=False``:
    it was inherited from the class, and removing ours restores it), and ours."""

    owner: Any
    name: str
    where: str
    own: bool
    found: Any
    ours: Any

    def apply(self) -> None:
        setattr(self.owner, self.name, self.ours)

    def still_ours(self) -> bool:
        return vars(self.owner).get(self.name, _MISSING) is self.ours

    def undo(self) -> None:
        if self.own:
            setattr(self.owner, self.name, self.found)
        else:
            delattr(self.owner, self.name)


_MISSING = object()


@attrs.frozen
class _CodeChange:
    """``function.__code__`` swapped ([Note: distribute_tensor's code])."""

    function: Any
    where: str
    found: Any
    ours: Any

    @property
    def name(self) -> str:
        return "__code__"

    def apply(self) -> None:
        self.function.__code__ = self.ours

    def still_ours(self) -> bool:
        return self.function.__code__ is self.ours

    def undo(self) -> None:
        self.function.__code__ = self.found


def _distribute_impl(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    src_data_rank: int | None,
) -> DTensor:
    if placements is None or not any(isinstance(p, RaggedShard) for p in placements):
        return torch_distribute(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    from ragged_dtensor._private.api import distribute_ragged

    return distribute_ragged(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def _distribute_trampoline(  # type: ignore[no-untyped-def]
    tensor, device_mesh=None, placements=None, *, src_data_rank=0
):
    # Runs as the code of torch's own distribute_tensor, so its globals are torch's _api
    # module's: the name below is injected there while the integration is installed.
    return _ragged_dtensor_distribute(  # type: ignore[name-defined]  # noqa: F821
        tensor, device_mesh, placements, src_data_rank
    )


def _distribute_changes() -> list[Any]:
    where = "torch.distributed.tensor.distribute_tensor"
    if vars(dtensor_api).get("distribute_tensor") is not _TORCH_DISTRIBUTE:
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not the function torch defined at import but "
            f"{_describe(vars(dtensor_api).get('distribute_tensor'))}. {_REFUSING}"
        )
    params = list(inspect.signature(_TORCH_DISTRIBUTE).parameters)
    if (
        _TORCH_DISTRIBUTE.__code__ is not _TORCH_DISTRIBUTE_CODE
        or params != ["tensor", "device_mesh", "placements", "src_data_rank"]
        or _TORCH_DISTRIBUTE_CODE.co_freevars
    ):
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not torch 2.13's (its code was replaced, or its "
            f"parameters are {params}). {_REFUSING}"
        )
    if _IMPL_NAME in vars(dtensor_api):
        raise DTensorIntegrationError(
            f"ragged_dtensor: torch.distributed.tensor._api already has {_IMPL_NAME}. {_REFUSING}"
        )
    return [
        _Change(
            dtensor_api,
            _IMPL_NAME,
            f"torch.distributed.tensor._api.{_IMPL_NAME}",
            False,
            None,
            _distribute_impl,
        ),
        _CodeChange(
            _TORCH_DISTRIBUTE, where, _TORCH_DISTRIBUTE_CODE, _distribute_trampoline.__code__
        ),
    ]


def _plan() -> tuple[_Originals, list[Any]]:
    """Check every target (raising before anything is changed) and describe the changes."""
    _check_version()
    changes: list[Any] = []
    redistribute_name = "torch.distributed.tensor._redistribute.redistribute_local_tensor"
    redistribute = _expect_torch_function(
        vars(dtensor_redistribute).get("redistribute_local_tensor"),
        redistribute_name,
        "torch.distributed.tensor._redistribute",
        "redistribute_local_tensor",
        ("local_tensor", "current_spec", "target_spec"),
    )
    for module in _REDISTRIBUTE_MODULES:
        where = f"{module.__name__}.redistribute_local_tensor"
        found = vars(module).get("redistribute_local_tensor")
        if found is not redistribute:
            raise DTensorIntegrationError(
                f"ragged_dtensor: {where} is not torch's {redistribute_name} but "
                f"{_describe(found)}; another library may have replaced it. {_REFUSING}"
            )
        changes.append(
            _Change(module, "redistribute_local_tensor", where, True, found, _redistribute_hook)
        )

    dispatcher = DTensor._op_dispatcher
    propagator = dispatcher.sharding_propagator
    prop_module = "torch.distributed.tensor._sharding_prop"
    where = "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding_non_cached"
    _expect_not_on_instance(propagator, "propagate_op_sharding_non_cached", where)
    propagate = _expect_torch_function(
        propagator.propagate_op_sharding_non_cached,
        where,
        prop_module,
        "ShardingPropagator.propagate_op_sharding_non_cached",
        ("self", "op_schema"),
    )
    tensor_meta = _expect_torch_function(
        propagator._propagate_tensor_meta_non_cached,
        "DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_non_cached",
        prop_module,
        "ShardingPropagator._propagate_tensor_meta_non_cached",
        ("self", "op_schema"),
    )
    cache = vars(propagator).get("propagate_op_sharding")
    cached = getattr(getattr(cache, "cache", None), "__wrapped__", None)
    if type(cache) is not dtensor_sharding_prop.LocalLRUCache or not (
        isinstance(cached, types.MethodType)
        and cached.__func__ is propagate
        and cached.__self__ is propagator
    ):
        raise DTensorIntegrationError(
            "ragged_dtensor: DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding "
            f"is not torch's LocalLRUCache of its propagate_op_sharding_non_cached but "
            f"{cache!r}. {_REFUSING}"
        )
    changes.append(
        _Change(propagator, "propagate_op_sharding_non_cached", where, False, None, _propagate_hook)
    )
    changes.append(
        _Change(
            propagator,
            "propagate_op_sharding",
            "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding",
            True,
            cache,
            dtensor_sharding_prop.LocalLRUCache(_propagate_hook),
        )
    )

    where = "DTensor._op_dispatcher._dispatch_get_local_results_slow_path"
    _expect_not_on_instance(dispatcher, "_dispatch_get_local_results_slow_path", where)
    slow_path = _expect_torch_function(
        dispatcher._dispatch_get_local_results_slow_path,
        where,
        "torch.distributed.tensor._dispatch",
        "OpDispatcher._dispatch_get_local_results_slow_path",
        ("self", "op_call", "args", "op_info"),
    )
    changes.append(
        _Change(
            dispatcher, "_dispatch_get_local_results_slow_path", where, False, None, _slow_path_hook
        )
    )

    for name, parameters in _CHECKPOINT_METHODS.items():
        original = _expect_torch_function(
            vars(DTensor).get(name),
            f"torch.distributed.tensor.DTensor.{name}",
            "torch.distributed.tensor._api",
            f"DTensor.{name}",
            parameters,
        )
        changes.append(
            _Change(
                DTensor,
                name,
                f"torch.distributed.tensor.DTensor.{name}",
                True,
                original,
                _checkpoint_hook(name, original),
            )
        )
    changes.extend(_distribute_changes())
    where = "torch.distributed._state_dict_utils._distribute_tensors"
    distribute_tensors = _expect_torch_function(
        vars(state_dict_utils).get("_distribute_tensors"),
        where,
        "torch.distributed._state_dict_utils",
        "_distribute_tensors",
        ("local_state_dict", "keys", "device", "pg"),
    )
    changes.append(
        _Change(
            state_dict_utils,
            "_distribute_tensors",
            where,
            True,
            distribute_tensors,
            _distribute_tensors_hook,
        )
    )
    changes.extend(handlers.handler_changes(_REFUSING, DTensorIntegrationError))
    originals = _Originals(
        redistribute=redistribute,
        propagate=types.MethodType(propagate, propagator),
        tensor_meta=types.MethodType(tensor_meta, propagator),
        slow_path=types.MethodType(slow_path, dispatcher),
        distribute_tensors=distribute_tensors,
    )
    return originals, changes


# -- install / uninstall -----------------------------------------------------------------------

_LOCK = threading.RLock()
_CHANGES: list[Any] = []
_INSTALLED = False


def _clear_sharding_caches() -> None:
    """Forget the C++ fast path's cached sharding decisions (this thread's): those made with the
    integration must not answer without it, and the other way round. (The Python cache is the
    propagator's attribute: ours is dropped with the integration, torch's is put back.)"""
    torch._C._clear_DTensor_sharding_propagator_cache()


def install_dtensor_integration() -> None:
    """Install the DTensor integration (idempotent, all or nothing)."""
    global _ORIGINALS, _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        originals, changes = _plan()
        _ORIGINALS = originals
        applied: list[Any] = []
        try:
            for change in changes:
                change.apply()
                applied.append(change)
            _clear_sharding_caches()
            ragged_debug.enter_from_env()
        except BaseException:
            for change in reversed(applied):
                change.undo()
            _ORIGINALS = None
            raise
        _CHANGES[:] = changes
        _INSTALLED = True


def ensure_installed() -> None:
    """Install the integration unless it is installed (the placement calls this)."""
    if not _INSTALLED:
        install_dtensor_integration()


def uninstall_dtensor_integration() -> None:
    """Remove the integration: torch's own objects are put back (no-op when not installed).

    Ragged DTensors must not be used while it is removed (constructing a RaggedShard installs
    it again).
    """
    global _ORIGINALS, _INSTALLED
    with _LOCK:
        if not _INSTALLED:
            return
        replaced = [c.where for c in _CHANGES if not c.still_ours()]
        if replaced:
            raise DTensorIntegrationError(
                f"ragged_dtensor: cannot remove the DTensor integration: {', '.join(replaced)} "
                f"no longer hold ragged_dtensor's wrappers (another library replaced them after "
                f"the install); nothing was changed"
            )
        try:
            ragged_debug.exit_env_checks()
        except RuntimeError as exc:
            raise DTensorIntegrationError(
                f"ragged_dtensor: cannot remove the DTensor integration ({exc}); nothing was "
                f"changed"
            ) from None
        for change in reversed(_CHANGES):
            change.undo()
        _clear_sharding_caches()
        _CHANGES.clear()
        _ORIGINALS = None
        _INSTALLED = False


def dtensor_integration_installed() -> bool:
    """Whether the DTensor integration is installed now."""
    return _INSTALLED


@contextlib.contextmanager
def dtensor_integration() -> Iterator[None]:
    """Install the integration for a block; on exit, remove it unless it was installed before."""
    was = _INSTALLED
    install_dtensor_integration()
    try:
        yield
    finally:
        if not was:
            uninstall_dtensor_integration()


def hooks_installed() -> dict[str, bool]:
    """Which parts of the integration are in place now (every key False when not installed)."""
    parts = {
        "redistribute": ("redistribute_local_tensor",),
        "propagator": ("propagate_op_sharding_non_cached", "propagate_op_sharding"),
        "random": ("_dispatch_get_local_results_slow_path",),
        "checkpoint": tuple(_CHECKPOINT_METHODS),
        "distribute_tensor": (_IMPL_NAME,),
        "state_dict": ("_distribute_tensors",),
        "custom_handlers": tuple(f"custom_op_handler:{op}" for op in handlers.HANDLED),
    }
    with _LOCK:
        names = {c.name for c in _CHANGES if c.still_ours()}
    return {part: all(n in names for n in members) for part, members in parts.items()}
