"""``fully_shard`` and ``FSDPModule``: FSDP2's API, our machinery."""

from __future__ import annotations

import hashlib
import math
import operator
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard

from dbuffer import LayoutMismatchError
from fsdp_engine._private.group import ParamGroup, ParamRef
from fsdp_engine._private.policy import (
    BlockPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from fsdp_engine._private.state import STATE_ATTR, FSDPState, get_state
from ragged_dtensor import check_ranks_agree
from shard_planner import METHODS as PLANNER_METHODS
from shard_planner import Plan

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard"]

_CLASS_CACHE: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gather and
    registers the unsharded parameters."""

    def __init__(self, state: FSDPState) -> None:
        self._state = state

    def wait(self) -> None:
        group = self._state.group
        if group is not None:
            group.wait_for_unshard()
            group.register_unsharded()


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to (like FSDP2)."""

    def _engine_state(self) -> FSDPState:
        assert isinstance(self, nn.Module)
        state = get_state(self)
        if state is None:  # pragma: no cover - only fully_shard creates FSDPModules
            raise RuntimeError("module has no fully_shard state")
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        return self._subtree_states() if recurse else [self._engine_state()]

    def _subtree_states(self) -> list[FSDPState]:
        assert isinstance(self, nn.Module)
        states: list[FSDPState] = []
        for m in self.modules():
            state = get_state(m)
            if state is not None and state not in states:
                states.append(state)
        return states

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (one collective) and register them unsharded."""
        state = self._engine_state()
        if state.group is not None:
            state.group.unshard(async_op=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def shard_plan(self) -> Plan | None:
        """The planner's layout of this module's group (shard size, offsets, padding, per-rank
        units, fingerprint), or None when the module manages no parameters."""
        group = self._engine_state().group
        return None if group is None else group.plan

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones."""
        state = self._engine_state()
        if state.group is not None:
            state.group.reshard()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: accumulate unsharded gradients locally (no reduce-scatter) until set back."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(
        self, reshard_after_forward: bool, *, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            if state.is_root:
                continue
            state.reshard_after_forward = reshard_after_forward

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters asynchronously when this module's forward
        starts."""
        self._engine_state().forward_prefetch = [_state_of(m, "forward prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """All-gather these modules' parameters asynchronously when this module's backward starts
        (default: the module that ran forward just before this one)."""
        self._engine_state().backward_prefetch = [
            _state_of(m, "backward prefetch") for m in modules
        ]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward does not wait for its gradient reductions (they are
        waited at the next forward or optimizer-visible use)."""
        for state in self._subtree_states():
            state.is_last_backward = is_last_backward

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of averaging over the data-parallel ranks."""
        if factor <= 0:
            raise ValueError(f"divide factor must be > 0, got {factor}")
        for state in self._subtree_states():
            if state.group is not None:
                state.group.divide_factor = float(factor)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``to_empty``/``.to`` replace the sharded parameters' local tensors: put ours back.
        self.reshard()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for state in self._subtree_states():
            if state.group is not None:
                state.group.reset_sharded_params()
        return ret


def _state_of(module: object, what: str) -> FSDPState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"{what}: {type(module).__name__} is not a fully_shard module")
    return state


def _default_mesh() -> DeviceMesh:
    if not dist.is_initialized():
        raise RuntimeError("fully_shard needs torch.distributed to be initialized (or pass mesh=)")
    backend = dist.get_backend()
    device = "cpu" if backend == "gloo" else torch.accelerator.current_accelerator() or "cpu"
    return init_device_mesh(str(getattr(device, "type", device)), (dist.get_world_size(),))


# id(original parameter) -> (weak reference to it, its name in the fully_shard call managing it).
# Keyed by id: weak references to tensors compare by tensor ``==``, which is elementwise.
_MANAGED: dict[int, tuple[weakref.ref[nn.Parameter], str]] = {}


def _managed_by(param: nn.Parameter) -> str | None:
    entry = _MANAGED.get(id(param))
    return entry[1] if entry is not None and entry[0]() is param else None


def _remember(param: nn.Parameter, fqn: str) -> None:
    key = id(param)
    _MANAGED[key] = (weakref.ref(param, lambda _: _MANAGED.pop(key, None)), fqn)


def _managed_params(modules: Sequence[nn.Module], ignored: set[nn.Parameter]) -> list[ParamRef]:
    """Parameters of ``modules`` not owned by a nested fully_shard module (nor ignored), each
    once, with the other places that register the same object (tied weights) as aliases. With
    several modules (one group for all), names are prefixed by the module's index in the list."""
    found: dict[int, tuple[nn.Parameter, list[tuple[nn.Module, str, str]]]] = {}
    targets = {id(m) for m in modules}

    def visit(mod: nn.Module, prefix: str) -> None:
        if id(mod) not in targets and get_state(mod) is not None:
            return
        for attr, param in mod._parameters.items():
            if param is None or param in ignored:
                continue
            found.setdefault(id(param), (param, []))[1].append((mod, attr, prefix + attr))
        for name, child in mod._modules.items():
            if child is not None:
                visit(child, f"{prefix}{name}.")

    for index, module in enumerate(modules):
        visit(module, f"{index}." if len(modules) > 1 else "")
    refs = []
    for param, places in found.values():
        owner, attr, fqn = places[0]
        other = _managed_by(param)
        if other is not None:
            raise ValueError(
                f"parameter {fqn!r} is shared (tied) with a parameter already managed by another "
                f"fully_shard group ({other!r}): tied parameters must be in one group "
                f"(fully_shard their common parent)"
            )
        aliases = tuple((m, a) for m, a, _ in places[1:])
        refs.append(ParamRef(owner, attr, fqn, aliases))
    return refs


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    block_policy: BlockPolicy | None = ...,
    planner: str = ...,
) -> FSDPModule: ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    block_policy: BlockPolicy | None = ...,
    planner: str = ...,
) -> list[FSDPModule]: ...


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int = True,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen value
    offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen value
    ignored_params: set[nn.Parameter] | None = None,
    block_policy: BlockPolicy | None = None,
    planner: str = "auto",
) -> FSDPModule | list[FSDPModule]:
    """Shard ``module``'s parameters over ``mesh`` (FSDP2's signature and behaviour).

    One call makes one group: its parameters are planned into one flat buffer (no block of
    ``block_policy`` cut by a shard boundary), held as ``RaggedShard`` DTensor views, all-gathered
    with one collective before forward (and backward) and reduce-scattered with one collective
    after backward. ``mesh``: 1-D (FSDP) or 2-D (HSDP: axis 0 replicates, axis 1 shards).
    ``reshard_after_forward``: ``True``/``False``, or an int: ``1`` keeps parameters unsharded
    like ``False``, the shard-axis size reshards like ``True``, any other divisor k keeps 1/k of
    the unsharded buffer and re-gathers within groups of k ranks. ``planner``: the
    ``shard_planner.plan`` method (``"auto"``; ``"naive"`` concatenates, for ablations).
    """
    if planner not in PLANNER_METHODS:
        raise ValueError(f"fully_shard: planner must be one of {PLANNER_METHODS}, got {planner!r}")
    modules = module if isinstance(module, list) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for target in modules:
        if not isinstance(target, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module, got {type(target).__name__}")
        if get_state(target) is not None:
            raise ValueError(f"fully_shard was already applied to this {type(target).__name__}")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard got the same module twice in its list")
    target = modules[0]
    block_policy = _with_placement_fn(block_policy, shard_placement_fn)
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    mp_policy = _check_mp_policy(mp_policy)
    offload_policy = _check_offload_policy(offload_policy)
    mesh = mesh or _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard supports a 1-D (FSDP) or 2-D (HSDP) mesh, got {mesh.ndim}-D {mesh}"
        )
    shard_axis = mesh.ndim - 1
    world = mesh.size(shard_axis)
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError("CPUOffloadPolicy on an accelerator mesh is not supported yet")
    subgroup = 0
    if isinstance(reshard_after_forward, bool):
        reshard = reshard_after_forward
    elif isinstance(reshard_after_forward, int):
        if reshard_after_forward < 1 or world % reshard_after_forward:
            raise ValueError(
                f"reshard_after_forward={reshard_after_forward} must be a positive divisor of the "
                f"shard-axis size {world} (1: keep unsharded, {world}: reshard fully)"
            )
        reshard = reshard_after_forward != 1
        if 1 < reshard_after_forward < world:
            subgroup = reshard_after_forward
    else:
        raise TypeError(
            f"reshard_after_forward must be bool or int, got {type(reshard_after_forward).__name__}"
        )
    refs = _managed_params(modules, set(ignored_params or ()))
    _check_ranks_agree(
        mesh,
        {
            "module": ",".join(type(m).__name__ for m in modules),
            "reshard_after_forward": repr(reshard_after_forward),
            "mp_policy": repr(mp_policy),
            "offload_policy": repr(offload_policy),
            "block_policy": "none" if block_policy is None else type(block_policy).__name__,
        },
        refs,
    )
    for ref in refs:
        _remember(getattr(ref.owner, ref.attr), ref.fqn)
    _check_devices(refs, mesh)
    group = (
        ParamGroup(
            refs,
            mesh,
            mp_policy=mp_policy,
            block_policy=block_policy,
            shard_axis=shard_axis,
            planner=planner,
        )
        if refs
        else None
    )
    if group is not None and subgroup:
        group.setup_subgroup(subgroup)
    state = FSDPState(modules, group, reshard_after_forward=reshard, mp_policy=mp_policy)
    results: list[FSDPModule] = []
    for target in modules:
        target.__dict__[STATE_ATTR] = state
        cls = type(target)
        new_cls = _CLASS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLASS_CACHE[cls] = new_cls
        target.__class__ = new_cls
        assert isinstance(target, FSDPModule)
        results.append(target)
    return results if isinstance(module, list) else results[0]


def _with_placement_fn(
    block_policy: BlockPolicy | None, shard_placement_fn: Callable[[nn.Parameter], Any] | None
) -> BlockPolicy | None:
    """FSDP2's ``shard_placement_fn`` in our terms: ``None`` keeps the default, ``Shard(0)``
    means "cut between dim-0 slices only" (a block of one slice, combined with any block
    policy by LCM); other placements are not expressible in one planned flat buffer."""
    if shard_placement_fn is None:
        return block_policy
    placement_fn = shard_placement_fn

    def policy(name: str, param: torch.Tensor) -> int:
        base = 1 if block_policy is None else operator.index(block_policy(name, param))
        placement = placement_fn(param)  # type: ignore[arg-type]
        if placement is None:
            return base
        if isinstance(placement, Shard) and placement.dim % max(1, param.dim()) == 0:
            row = param.numel() // param.shape[0] if param.dim() and param.shape[0] else 1
            return math.lcm(base, max(1, row))
        raise NotImplementedError(
            f"shard_placement_fn returned {placement!r} for parameter {name!r}: only Shard(0) "
            f"(whole dim-0 slices per rank) or None can be laid out in the planned flat buffer"
        )

    return policy


def _check_ranks_agree(
    mesh: DeviceMesh, settings: dict[str, str], refs: Sequence[ParamRef]
) -> None:
    """Every rank must call fully_shard with the same settings on the same parameters: compare
    them with the agreement check every package shares (one 32-byte all-gather per mesh axis)
    and raise on every rank, naming the setting or parameter, instead of letting mismatched
    collectives hang or abort later, or training go silently wrong.

    Besides the settings, each parameter's ``requires_grad`` (a parameter frozen on some ranks
    only would have its gradient averaged with those ranks' zeros) and the value of each frozen
    parameter (never updated, so a difference at sharding time would stay forever: each rank's
    shard comes from its own copy) are compared, by SHA-256 of the values' bytes."""
    record = dict(settings)
    for ref in refs:
        param = getattr(ref.owner, ref.attr)
        record[f"requires_grad of {ref.fqn!r}"] = str(bool(param.requires_grad))
        if not param.requires_grad and not param.is_meta:
            record[f"value of frozen parameter {ref.fqn!r}"] = _value_digest(param)
    check_ranks_agree(
        mesh,
        record,
        what="fully_shard: ranks disagree on the settings or parameters of this call",
        error=LayoutMismatchError,
    )


def _value_digest(param: torch.Tensor) -> str:
    """SHA-256 of the local values' bytes, with the shape and dtype (a DTensor: its local
    shard, which the ranks of the data-parallel mesh hold identically)."""
    local = param.to_local() if isinstance(param, DTensor) else param
    flat = local.detach().reshape(-1).contiguous().cpu()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    digest = hashlib.sha256(data).hexdigest()[:32]
    return f"{tuple(param.shape)} {param.dtype} sha256:{digest}"


def _check_mp_policy(policy: object) -> MixedPrecisionPolicy:
    """Ours, or any object with FSDP2's fields (so torch's MixedPrecisionPolicy works too)."""
    if isinstance(policy, MixedPrecisionPolicy):
        return policy
    fields = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
    if all(hasattr(policy, f) for f in fields):
        return MixedPrecisionPolicy(*(getattr(policy, f) for f in fields))
    raise TypeError(
        f"fully_shard: mp_policy must be a MixedPrecisionPolicy (fields {fields}), "
        f"got {type(policy).__name__}"
    )


def _check_offload_policy(policy: object) -> OffloadPolicy:
    """Ours, or torch FSDP2's OffloadPolicy / CPUOffloadPolicy."""
    if isinstance(policy, OffloadPolicy):
        return policy
    from torch.distributed import fsdp as torch_fsdp

    if isinstance(policy, torch_fsdp.CPUOffloadPolicy):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if isinstance(policy, torch_fsdp.OffloadPolicy):
        return OffloadPolicy()
    raise TypeError(
        f"fully_shard: offload_policy must be an OffloadPolicy or CPUOffloadPolicy, "
        f"got {type(policy).__name__}"
    )


def _check_devices(refs: Iterable[ParamRef], mesh: DeviceMesh) -> None:
    devices: dict[str, str] = {}
    for ref in refs:
        param = getattr(ref.owner, ref.attr)
        if param.is_meta:
            continue
        devices.setdefault(param.device.type, ref.fqn)
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: parameters on different devices: "
            f"{ {k: f'e.g. {v}' for k, v in devices.items()} }"
        )
    for kind, fqn in devices.items():
        if kind != mesh.device_type:
            raise ValueError(
                f"fully_shard: parameter {fqn!r} is on {kind} but the mesh is "
                f"{mesh.device_type}; move the module first (or init on meta)"
            )
