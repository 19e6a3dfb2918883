"""Collecting, validating and agreeing on the parameters of a ``fully_shard`` call
(FSDP2's ``_fsdp_init``): which parameters a call manages, FSDP2's rules for them, the device,
``reshard_after_forward`` and ``shard_placement_fn`` in our terms, and the check that every rank
called it alike."""

from __future__ import annotations

import math
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard import _fsdp_api as torch_fsdp_api
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from dbuffer import LayoutMismatchError
from fsdp_engine._private import compat
from fsdp_engine._private.api import (
    BlockPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fsdp_engine._private.digest import value_digest
from fsdp_engine._private.param import ParamRef
from fsdp_engine._private.param_meshes import split_placement
from fsdp_engine._private.state import get_state
from fsdp_engine._private.subclass import is_subclass_tensor
from fsdp_engine._private.trace import warning_once
from ragged_dtensor import check_ranks_agree

__all__ = [
    "by_dtype",
    "check_mp_policy",
    "check_offload_policy",
    "check_param",
    "check_ranks_agree_on_call",
    "choose_device",
    "default_mesh",
    "managed_params",
    "parse_reshard_after_forward",
    "remember",
    "resolve_device",
    "with_placement_fn",
    "with_subclass_placement",
]


def default_mesh() -> DeviceMesh:
    """FSDP2's default: a 1-D mesh of every rank on the accelerator when there is one and the
    default process group serves it (by capability, never by the backend's name), else on
    the CPU. Like FSDP2, the default process group is initialized from the environment
    (``init_process_group()``: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...) when it is not
    yet; its error names the missing variable."""
    if not dist.is_initialized():
        dist.init_process_group()
    accelerator = torch.accelerator.current_accelerator()
    kind = "cpu"
    world = dist.group.WORLD
    serves = world is not None and accelerator is not None
    if serves and compat.has_backend_for(world, torch.device(accelerator.type)):  # type: ignore[union-attr]
        kind = accelerator.type  # type: ignore[union-attr]
    return init_device_mesh(kind, (dist.get_world_size(),))


# id(original parameter) -> (weak reference to it, its name in the fully_shard call managing it).
# Keyed by id: weak references to tensors compare by tensor ``==``, which is elementwise.
_MANAGED: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}


def managed_by(param: nn.Parameter) -> str | None:
    entry = _MANAGED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def remember(param: nn.Parameter, fqn: str) -> None:
    key = id(param)
    _MANAGED[key] = (weakref.ref(param, lambda _: _MANAGED.pop(key, None)), fqn)


def managed_params(modules: Sequence[nn.Module], ignored: set[nn.Parameter]) -> list[ParamRef]:
    """Parameters of ``modules`` not owned by a nested fully_shard module (nor ignored), each
    once, with the other places that register the same object (tied weights) as aliases. With
    several modules (one group for all), names are prefixed by the module's index in the list."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    targets = {id(m) for m in modules}

    def visit(mod: nn.Module, prefix: str) -> None:
        if id(mod) not in targets and get_state(mod) is not None:
            return
        for attr, param in mod.named_parameters(recurse=False, remove_duplicate=False):
            if param in ignored:
                continue
            found.setdefault(id(param), (param, []))[1].append((mod, attr, prefix + attr))
        for name, child in mod.named_children():
            visit(child, f"{prefix}{name}.")

    for index, module in enumerate(modules):
        visit(module, f"{index}." if len(modules) > 1 else "")
    refs = []
    for param, places in found.values():
        owner, attr, fqn = places[0]
        other = managed_by(param)
        if other is not None:
            raise ValueError(
                f"parameter {fqn!r} is shared (tied) with a parameter already managed by another "
                f"fully_shard group ({other!r}): tied parameters must be in one group "
                f"(fully_shard their common parent)"
            )
        aliases = tuple((m, a) for m, a, _ in places[1:])
        refs.append(ParamRef(owner, attr, fqn, aliases))
    return refs


def parse_reshard_after_forward(value: object, world: int) -> tuple[bool | None, int]:
    """FSDP2's ``reshard_after_forward`` rules: (None/True/False, sub-group size or 0)."""
    if value is None or isinstance(value, bool):
        return value, 0
    if not isinstance(value, int):
        raise ValueError(  # FSDP2's type and words
            "reshard_after_forward should be a bool or an int representing the group size to "
            f"reshard to, not {value!r} ({type(value).__name__})"
        )
    if value < 1 or value > world or world % value:
        raise ValueError(
            f"reshard_after_forward={value} must be a positive divisor of the shard-axis size "
            f"{world} (If passing reshard_after_forward as an int, it should be a factor of "
            f"{world}, not {value})"
        )
    if value == 1:
        # FSDP2's warning, once, on its logger ([Note: FSDP2's trace])
        warning_once(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)"
        )
        return False, 0
    if value == world:
        return True, 0
    return False, value


def check_param(ref: ParamRef) -> None:
    """FSDP2's contract for what a managed parameter may be."""
    param = ref.registered()
    if param.dim() == 0:
        raise ValueError(
            "fully_shard doesn't support scalar parameters. "
            f"Change {ref.fqn} to a 1D tensor with numel equal to 1."
        )
    local = param.to_local() if isinstance(param, DTensor) else param
    if not local.is_contiguous():
        raise NotImplementedError(
            f"FSDP does not support non-contiguous parameters yet: parameter {ref.fqn!r} has "
            f"param.shape={tuple(param.shape)} param.stride()={param.stride()}"
        )


def by_dtype(refs: Sequence[ParamRef]) -> list[list[ParamRef]]:
    """One group per dtype (of the local tensor), in order of first appearance."""
    groups: dict[torch.dtype, list[ParamRef]] = {}
    for ref in refs:
        param = ref.registered()
        local = param.to_local() if isinstance(param, DTensor) else param
        groups.setdefault(local.dtype, []).append(ref)
    return list(groups.values())


def with_placement_fn(
    block_policy: BlockPolicy | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    refs: Sequence[ParamRef],
    world: int,
) -> tuple[BlockPolicy | None, dict[str, int], dict[str, DeviceMesh]]:
    """FSDP2's ``shard_placement_fn`` in our terms: ``None`` keeps our planned layout;
    ``Shard(d)`` gives that parameter exactly FSDP2's placement and layout, in a group of its
    own (returned as ``{fqn: d}``; ``dim_shard`` [Note: Shard(d) groups]); for a tensor-parallel
    (DTensor) parameter ``Shard(0)`` means "cut our RaggedShard between dim-0 slices only" (a
    block of one slice, combined with any block policy by LCM).

    A user who names a placement gets it, as from FSDP2 (a drop-in keeps code that reads
    ``param.to_local()`` as dim-d chunks working); the price is FSDP2's: one collective per such
    parameter instead of one per call, and for d > 0 a copy out of the all-gather and into the
    reduce-scatter. FSDP2's own errors come first (an invalid dim, an uneven dim > 0). A
    ``ShardPlacementResult`` also puts the parameter on its mesh (returned as ``{fqn: mesh}``,
    [Note: per-parameter meshes]).
    """
    if shard_placement_fn is None:
        return block_policy, {}, {}
    chosen: dict[int, int] = {}
    dims: dict[str, int] = {}
    meshes: dict[str, DeviceMesh] = {}
    for ref in refs:
        param = ref.registered()
        placement, own_mesh = split_placement(shard_placement_fn(param), ref.fqn)
        size = world
        if own_mesh is not None:
            meshes[ref.fqn] = own_mesh
            size = own_mesh.size(own_mesh.ndim - 1)
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(
                f"shard_placement_fn returned {placement!r} for parameter {ref.fqn!r}: only "
                "Shard(dim), None or a ShardPlacementResult"
            )
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if dim >= param.dim():
            raise AssertionError(
                f"Shard dim {dim} is invalid for {param.dim()}D tensor: {tuple(param.shape)}"
            )
        # a tensor-parallel parameter is split by its local shard, as FSDP2 splits it
        local = param.to_local() if isinstance(param, DTensor) else param
        if dim > 0 and local.shape[dim] % size:
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {dim}: {tuple(local.shape)} "
                f"(world size: {size}) -- parameter {ref.fqn!r}"
            )
        if dim > 0 or not isinstance(param, DTensor):
            dims[ref.fqn] = dim  # [Note: placed groups], tensor-parallel ones included
            continue
        chosen[id(param)] = max(1, param.numel() // param.shape[0]) if param.shape[0] else 1
    if not chosen:
        return block_policy, dims, meshes

    def policy(name: str, param: torch.Tensor) -> int:
        base = 1 if block_policy is None else operator.index(block_policy(name, param))
        row = chosen.get(id(param))
        return base if row is None else math.lcm(base, row)

    return policy, dims, meshes


def with_subclass_placement(
    refs: Sequence[ParamRef], shard_dims: dict[str, int], block_policy: BlockPolicy | None
) -> dict[str, int]:
    """[Note: subclass parameters]: a parameter of a tensor subclass (which may define FSDP2's
    all-gather extension now or later) gets FSDP2's layout (``Shard(0)``, or what
    ``shard_placement_fn`` chose), and so do the call's other parameters of its dtype, so that
    they share its one all-gather as in FSDP2 (unless a ``block_policy`` asks for blocks kept
    whole: those stay planned, in a group of their own). A tensor-parallel parameter whose local
    tensor is a subclass is refused by name."""
    dims = dict(shard_dims)
    dtypes: set[torch.dtype] = set()
    for ref in refs:
        param = ref.registered()
        if isinstance(param, DTensor):
            if is_subclass_tensor(compat.local_tensor(param)):
                raise NotImplementedError(
                    f"fully_shard: parameter {ref.fqn!r} is a DTensor (tensor parallel) whose "
                    f"local tensor is a {type(compat.local_tensor(param)).__name__}: tensor-"
                    "subclass parameters are supported on the data-parallel mesh only, not "
                    "combined with tensor parallelism yet"
                )
            continue
        if is_subclass_tensor(param):
            dims.setdefault(ref.fqn, 0)
            dtypes.add(param.dtype)
    if dtypes and block_policy is None:
        for ref in refs:
            param = ref.registered()
            if not isinstance(param, DTensor) and param.dtype in dtypes:
                dims.setdefault(ref.fqn, 0)
    return dims


def check_ranks_agree_on_call(
    mesh: DeviceMesh, settings: dict[str, str], refs: Sequence[ParamRef]
) -> None:
    """Every rank must call fully_shard with the same settings on the same parameters: compare
    them with the agreement check every package shares (one 32-byte all-gather per mesh axis)
    and raise on every rank, naming the setting or parameter, instead of letting mismatched
    collectives hang or abort later, or training go silently wrong.

    Besides the settings, each parameter's ``requires_grad`` (a parameter frozen on some ranks
    only would have its gradient averaged with those ranks' zeros) and the value of each frozen
    parameter (never updated, so a difference at sharding time would stay forever: each rank's
    shard comes from its own copy) are compared, by a digest computed where the values are
    (``value_digest``: no host copy of the parameter)."""
    record = dict(settings)
    for ref in refs:
        param = getattr(ref.owner, ref.attr)
        record[f"requires_grad of {ref.fqn!r}"] = str(bool(param.requires_grad))
        if not param.requires_grad and not param.is_meta:
            record[f"value of frozen parameter {ref.fqn!r}"] = value_digest(param)
    check_ranks_agree(
        mesh,
        record,
        what="fully_shard: ranks disagree on the settings or parameters of this call",
        error=LayoutMismatchError,
    )


# [Note: torch's policy classes by identity]: the switch rebinds torch.distributed.fsdp's policy
# names to ours, so torch's classes are read once from FSDP2's implementation module (never
# rebound): a policy made from torch's class before the switch is accepted.
_TORCH_MP_POLICY = torch_fsdp_api.MixedPrecisionPolicy
_TORCH_OFFLOAD_POLICY = torch_fsdp_api.OffloadPolicy
_TORCH_CPU_OFFLOAD_POLICY = torch_fsdp_api.CPUOffloadPolicy
_MP_FIELDS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")


def check_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """Ours, torch FSDP2's ``MixedPrecisionPolicy`` (made before or after the switch: [Note:
    torch's policy classes by identity]), or any object with FSDP2's fields."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    if isinstance(policy, _TORCH_MP_POLICY) or all(hasattr(policy, f) for f in _MP_FIELDS):
        return MixedPrecisionPolicy(*(getattr(policy, f) for f in _MP_FIELDS))
    raise TypeError(
        f"fully_shard: mp_policy must be a MixedPrecisionPolicy (fields {_MP_FIELDS}), "
        f"got {type(policy).__module__}.{type(policy).__qualname__}"
    )


def check_offload_policy(policy: object) -> OffloadPolicy:
    """Ours, or torch FSDP2's ``OffloadPolicy`` / ``CPUOffloadPolicy`` (made before or after
    the switch: [Note: torch's policy classes by identity])."""
    if isinstance(policy, OffloadPolicy):
        return policy
    if isinstance(policy, _TORCH_CPU_OFFLOAD_POLICY):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if isinstance(policy, _TORCH_OFFLOAD_POLICY):
        return OffloadPolicy()
    raise TypeError(
        f"fully_shard: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, "
        f"got {type(policy).__module__}.{type(policy).__qualname__}"
    )


def resolve_device(refs: Iterable[ParamRef], mesh: DeviceMesh) -> torch.device:
    """The device the group's storage lives on: the parameters' device when they are on one
    (its index honoured: a model on ``cuda:3`` stays there, whatever the current device is),
    else the mesh's current device (meta parameters). Parameters on several devices, or on a
    device of another type than the mesh's, are refused by name."""
    devices: dict[torch.device, str] = {}
    for ref in refs:
        param = ref.registered()
        if param.is_meta:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        devices.setdefault(local.device, ref.fqn)
    return choose_device(devices, mesh.device_type)


def choose_device(devices: dict[torch.device, str], mesh_type: str) -> torch.device:
    """``resolve_device``'s rule on the parameters' devices (each with one parameter's name)."""
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: parameters on different devices: "
            f"{ {str(k): f'e.g. {v}' for k, v in devices.items()} }"
        )
    for device, fqn in devices.items():
        if device.type != mesh_type:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is on {device.type} but the mesh is "
                f"{mesh_type}; move the module first (or init on meta)"
            )
        if device.type != "cpu" and device.index is None:
            return mesh_device_for(mesh_type)
        return device
    return mesh_device_for(mesh_type)


def mesh_device_for(kind: str) -> torch.device:
    """The current device of a mesh's device type (FSDP2's ``_get_device_from_mesh``)."""
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, torch.get_device_module(kind).current_device())
