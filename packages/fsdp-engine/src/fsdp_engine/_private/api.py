"""``fully_shard`` and ``FSDPModule``: FSDP2's API, our machinery."""

from __future__ import annotations

import functools
import hashlib
import math
import operator
import warnings
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
from fsdp_engine._private.compat import mark_fully_sharded
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

__all__ = [
    "FSDPModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "share_comm_ctx",
]

_CLASS_CACHE: dict[type, type] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gathers
    and registers the unsharded parameters."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        state, self._state = self._state, None
        for group in state.groups if state is not None else ():
            group.wait_for_unshard()
            group.register_unsharded()


def _modules_of(module: FSDPModule, recurse: bool) -> list[FSDPState]:
    assert isinstance(module, nn.Module)
    states: list[FSDPState] = []
    for m in module.modules() if recurse else [module]:
        state = get_state(m)
        if state is not None and state not in states:
            states.append(state)
    return states


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to (like FSDP2)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A container's slicing (``layers[1:]``) builds ``type(self)(...)``: build the original
        # class, like FSDP2 (the new container is not a fully_shard module).
        orig: Any = cls.__mro__[2]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def _engine_state(self) -> FSDPState:
        assert isinstance(self, nn.Module)
        state = get_state(self)
        if state is None:  # pragma: no cover - only fully_shard creates FSDPModules
            raise RuntimeError("module has no fully_shard state")
        return state

    def _states(self, recurse: bool) -> list[FSDPState]:
        return _modules_of(self, recurse)

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters (one collective per group) and register them
        unsharded. Not recursive."""
        state = self._engine_state()
        for group in state.groups:
            group.adopt_registered()  # parameters assigned since fully_shard (no-op if unsharded)
            group.unshard(async_op=async_op)
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def shard_plan(self) -> Plan | None:
        """The planner's layout of this module's group (shard size, offsets, padding, per-rank
        units, fingerprint), or None when the module manages no parameters. A call whose
        parameters have several dtypes has one plan per dtype: see ``shard_plans()``."""
        plans = self.shard_plans()
        if len(plans) > 1:
            raise ValueError(
                f"this fully_shard call holds {len(plans)} groups (one per dtype); "
                "use shard_plans()"
            )
        return plans[0] if plans else None

    def shard_plans(self) -> list[Plan]:
        """One plan per dtype group of this module, in the order the dtypes first appear."""
        return [group.plan for group in self._engine_state().groups]

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones. Not recursive."""
        for group in self._engine_state().groups:
            group.reshard()

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: wait for or drop every collective in
        flight, reshard, and return every state to idle (the failed iteration's gradients,
        including accumulated ones, are dropped). Call it on the root."""
        state = self._engine_state()
        if state.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        state.reset_iteration()

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: accumulate gradients locally (no reduce-scatter, in ``reduce_dtype``)
        until set back."""
        for state in self._states(recurse):
            state.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: reduce-scatter every microbatch but all-reduce only when set back. The engine
        reduces both axes together; only ``True`` (the default) is supported on a 2-D mesh."""
        for state in self._states(recurse):
            if not requires_all_reduce and any(g.mesh.ndim > 1 for g in state.groups):
                raise NotImplementedError(
                    "set_requires_all_reduce(False): reduce-scatter without the replica "
                    "all-reduce is not supported by fsdp_engine; use "
                    "set_requires_gradient_sync(False) to accumulate without communication"
                )

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for state in self._states(recurse):
            state.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at runtime (e.g. ``True`` on the root, or ``False``
        for evaluation). Explicit, so it also applies to the root."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for state in self._states(recurse):
            state.auto_reshard_after_forward = False
            state.reshard_after_forward = reshard_after_forward
            for group in state.groups:
                group.subgroup = None

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
        waited at the next forward)."""
        self._engine_state().ctx.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of averaging over the data-parallel ranks."""
        if factor <= 0:
            raise ValueError(f"divide factor must be > 0, got {factor}")
        for group in self._engine_state().groups:
            group.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of ``set_gradient_divide_factor`` (as in FSDP2)."""
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only SUM collectives: the average is a division before the reduction."""
        for group in self._engine_state().groups:
            group.force_sum_reduction = enable
            if enable and group.divide_factor is None:
                group.divide_factor = float(group.mesh.size())

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """fsdp_engine always reduces every trainable parameter of a group, unused ones as zeros
        ([Note: conditional compute]), so ranks that use different parameters never issue
        mismatched collectives, whatever this says; every trainable parameter of a reduced
        group keeps a ``.grad`` (``True``, the engine's default). ``False``: parameters no rank
        used lose their ``.grad`` (as with one process, or DDP's ``find_unused_parameters``),
        at the cost of one small all-reduce per backward ([Note: gradient presence])."""
        for state in self._states(recurse):
            for group in state.groups:
                group.exact_presence = not reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Accepted for FSDP2 compatibility (validated); the engine keeps one reduction in
        flight, whose input is the group's own gradient storage (no copy-in buffer)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        self._states(recurse)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not all-gather this module's parameters in backward (when its backward
        does not read them, e.g. an embedding); gradients are still reduced."""
        self._engine_state().unshard_in_backward = unshard_in_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """An event recorded after the optimizer step: the root's next pre-forward makes the
        current stream wait on it (accelerators) before the all-gathers; discarded after use."""
        self._engine_state().ctx.post_optim_event = event

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """``hook(reduce_output)`` runs on each group's reduced gradient shard (reduce dtype),
        after the replica all-reduce with HSDP, before it is written to ``.grad``. ``stream``
        (only without native HSDP) is the stream it runs in."""
        for group in self._engine_state().groups:
            if stream is not None and group.mesh.ndim > 1:
                raise ValueError("stream cannot be set when using native HSDP")
            group.all_reduce_hook = _on_stream(hook, stream, group.mesh.device_type)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Replace the all-gather: ``comm(output_tensor=, input_tensor=, group=, async_op=)`` is
        called with the group's own flat buffers (its ``allocate`` is not used)."""
        for group in self._engine_state().groups:
            group.custom_all_gather = comm

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Replace the reduce-scatter: ``comm(output_tensor=, input_tensor=, group=, op=,
        async_op=)`` with the group's own flat buffers (its ``allocate`` is not used)."""
        for group in self._engine_state().groups:
            group.custom_reduce_scatter = comm

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2 allocates its staging buffers from the process group's allocator. The engine
        has no staging buffers (collectives read and write the planned persistent storage), so
        this changes nothing; like FSDP2 it cannot be combined with a custom collective."""
        for group in self._engine_state().groups:
            if group.custom_all_gather is not None or group.custom_reduce_scatter is not None:
                raise AssertionError(
                    "set_allocate_memory_from_process_group_for_comm cannot be used together "
                    "with set_custom_all_gather / set_custom_reduce_scatter"
                )

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        raise NotImplementedError(
            "set_separate_reduce_scatter_group: fsdp_engine runs its all-gathers and "
            "reduce-scatters on the mesh's process groups"
        )

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        raise NotImplementedError(
            "set_symm_mem_for_comm: fsdp_engine's collectives move the planned persistent "
            "buffers, which are not symmetric-memory allocations"
        )

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``.to(dtype)``, ``.float()``, ``to_empty`` replace or re-type the sharded parameters'
        # local tensors: adopt what they became into our storage (children do their own).
        state = self._engine_state()
        for group in state.groups:
            group.to_sharded()
        ret = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in state.groups:
            group.reset_after_apply()
        return ret


def _on_stream(
    hook: Callable[[torch.Tensor], None], stream: torch.Stream | None, device_type: str
) -> Callable[[torch.Tensor], None]:
    if stream is None:
        return hook
    module = torch.get_device_module(device_type)

    def run(output: torch.Tensor) -> None:
        with module.stream(stream):
            hook(output)

    return run


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard/reshard like ``forward`` (FSDP2's function); a no-op
    for modules that are not fully_shard modules."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"{type(module)} does not have a method {method_name}")
    original = getattr(module, method_name)
    state = module._engine_state()

    @functools.wraps(original)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        assert isinstance(module, nn.Module)
        args, kwargs = state._pre_forward(module, args, kwargs)
        out = original(*args, **kwargs)
        return state._post_forward(module, args, out)

    setattr(module, method_name, wrapped)


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """FSDP2 shares communication streams between roots (pipeline stages). The engine's
    communication stream is already one per device, shared by every module: this validates the
    list and changes nothing."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


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
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: Any = ...,
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
    dp_mesh_dims: Any = ...,
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
    dp_mesh_dims: Any = None,
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
    """
    if planner not in PLANNER_METHODS:
        raise ValueError(f"fully_shard: planner must be one of {PLANNER_METHODS}, got {planner!r}")
    if dp_mesh_dims is not None:
        raise NotImplementedError(
            "fully_shard(dp_mesh_dims=...): pass the data-parallel mesh itself as mesh= "
            "(1-D FSDP or 2-D HSDP); tensor-parallel DTensor parameters are sharded on it"
        )
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
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a DeviceMesh, got {type(mesh).__name__}")
    mp_policy = _check_mp_policy(mp_policy)
    offload_policy = _check_offload_policy(offload_policy)
    mesh = mesh or _default_mesh()
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}")
    if mesh.ndim == 2 and mesh.mesh_dim_names is None:
        raise AssertionError("Please init the 2D mesh for HSDP with mesh_dim_names specified")
    shard_axis = mesh.ndim - 1
    world = mesh.size(shard_axis)
    if isinstance(offload_policy, CPUOffloadPolicy) and mesh.device_type != "cpu":
        raise NotImplementedError("CPUOffloadPolicy on an accelerator mesh is not supported yet")
    reshard, subgroup = _reshard_after_forward(reshard_after_forward, world)
    refs = _managed_params(modules, set(ignored_params or ()))
    for ref in refs:
        _check_param(ref)
    block_policy, shard_dims = _with_placement_fn(block_policy, shard_placement_fn, refs, world)
    _check_ranks_agree(
        mesh,
        {
            "module": ",".join(type(m).__name__ for m in modules),
            "reshard_after_forward": repr(reshard_after_forward),
            "mp_policy": repr(mp_policy),
            "offload_policy": repr(offload_policy),
            "block_policy": "none" if block_policy is None else type(block_policy).__name__,
            # the groups follow it: a rank-dependent shard_placement_fn is named, not a hang
            "shard_placement_fn": repr(sorted(shard_dims.items())),
        },
        refs,
    )
    for ref in refs:
        _remember(ref.registered(), ref.fqn)
    _check_devices(refs, mesh)
    planned = [r for r in refs if r.fqn not in shard_dims]
    groups = [
        ParamGroup(
            members,
            mesh,
            mp_policy=mp_policy,
            block_policy=block_policy,
            shard_axis=shard_axis,
            planner=planner,
        )
        for members in _by_dtype(planned)
    ]
    # [Note: Shard(d) groups]: each such parameter is a group of its own
    groups += [
        ParamGroup(
            [ref],
            mesh,
            mp_policy=mp_policy,
            block_policy=None,
            shard_axis=shard_axis,
            shard_dim=shard_dims[ref.fqn],
        )
        for ref in refs
        if ref.fqn in shard_dims
    ]
    for group in groups:
        if subgroup:
            group.setup_subgroup(subgroup)
    state = FSDPState(modules, groups, reshard_after_forward=reshard, mp_policy=mp_policy)
    results: list[FSDPModule] = []
    for target in modules:
        target.__dict__[STATE_ATTR] = state
        mark_fully_sharded(target)
        cls = type(target)
        new_cls = _CLASS_CACHE.get(cls)
        if new_cls is None:
            new_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
            _CLASS_CACHE[cls] = new_cls
        target.__class__ = new_cls
        assert isinstance(target, FSDPModule)
        results.append(target)
    return results if isinstance(module, list) else results[0]


def _reshard_after_forward(value: object, world: int) -> tuple[bool | None, int]:
    """FSDP2's ``reshard_after_forward`` rules: (None/True/False, sub-group size or 0)."""
    if value is None or isinstance(value, bool):
        return value, 0
    if not isinstance(value, int):
        raise TypeError(
            f"reshard_after_forward must be None, bool or int, got {type(value).__name__}"
        )
    if value < 1 or value > world or world % value:
        raise ValueError(
            f"reshard_after_forward={value} must be a positive divisor of the shard-axis size "
            f"{world} (If passing reshard_after_forward as an int, it should be a factor of "
            f"{world}, not {value})"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool); it keeps them unsharded",
            stacklevel=3,
        )
        return False, 0
    if value == world:
        return True, 0
    return False, value


def _check_param(ref: ParamRef) -> None:
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


def _by_dtype(refs: Sequence[ParamRef]) -> list[list[ParamRef]]:
    """One group per dtype (of the local tensor), in order of first appearance."""
    groups: dict[torch.dtype, list[ParamRef]] = {}
    for ref in refs:
        param = ref.registered()
        local = param.to_local() if isinstance(param, DTensor) else param
        groups.setdefault(local.dtype, []).append(ref)
    return list(groups.values())


def _with_placement_fn(
    block_policy: BlockPolicy | None,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None,
    refs: Sequence[ParamRef],
    world: int,
) -> tuple[BlockPolicy | None, dict[str, int]]:
    """FSDP2's ``shard_placement_fn`` in our terms: ``None`` keeps our planned layout;
    ``Shard(d)`` gives that parameter exactly FSDP2's placement and layout, in a group of its
    own (returned as ``{fqn: d}``; ``dim_shard`` [Note: Shard(d) groups]); for a tensor-parallel
    (DTensor) parameter ``Shard(0)`` means "cut our RaggedShard between dim-0 slices only" (a
    block of one slice, combined with any block policy by LCM).

    A user who names a placement gets it, as from FSDP2 (a drop-in keeps code that reads
    ``param.to_local()`` as dim-d chunks working); the price is FSDP2's: one collective per such
    parameter instead of one per call, and for d > 0 a copy out of the all-gather and into the
    reduce-scatter. FSDP2's own errors come first (an invalid dim, an uneven dim > 0).
    """
    if shard_placement_fn is None:
        return block_policy, {}
    chosen: dict[int, int] = {}
    dims: dict[str, int] = {}
    for ref in refs:
        param = ref.registered()
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if not isinstance(placement, Shard):
            raise NotImplementedError(
                f"shard_placement_fn returned {placement!r} for parameter {ref.fqn!r}: only "
                "Shard(dim) or None (per-parameter meshes are not supported by fsdp_engine)"
            )
        dim = placement.dim + param.dim() if placement.dim < 0 else placement.dim
        if dim >= param.dim():
            raise AssertionError(
                f"Shard dim {dim} is invalid for {param.dim()}D tensor: {tuple(param.shape)}"
            )
        if dim > 0 and param.shape[dim] % world:
            raise NotImplementedError(
                f"FSDP does not support uneven sharding on dim {dim}: {tuple(param.shape)} "
                f"(world size: {world}) -- parameter {ref.fqn!r}"
            )
        if dim > 0 or not isinstance(param, DTensor):
            if isinstance(param, DTensor):
                raise NotImplementedError(
                    f"shard_placement_fn asked for Shard({placement.dim}) of the tensor-parallel "
                    f"parameter {ref.fqn!r}: fsdp_engine shards DTensor parameters with "
                    "RaggedShard on the data-parallel axis only; return None or Shard(0)"
                )
            dims[ref.fqn] = dim
            continue
        chosen[id(param)] = max(1, param.numel() // param.shape[0]) if param.shape[0] else 1
    if not chosen:
        return block_policy, dims

    def policy(name: str, param: torch.Tensor) -> int:
        base = 1 if block_policy is None else operator.index(block_policy(name, param))
        row = chosen.get(id(param))
        return base if row is None else math.lcm(base, row)

    return policy, dims


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
        param = ref.registered()
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
