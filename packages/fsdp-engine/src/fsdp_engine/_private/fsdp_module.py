"""``FSDPModule``: the methods ``fully_shard`` adds to a module (FSDP2's names and arguments).

Every setter validates its arguments and hands them to one configuration entry
(``FSDPState.configure`` or ``ParamGroup.configure``); none writes a state's or group's fields.

[Note: one of torch's FSDPModules]
Trainers ask ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` before they use FSDP's methods
(torchtitan's switch that turns off the gradient division, its loss code, Lightning Fabric's
no-sync toggle): a module that fails it silently loses that handling. So our ``FSDPModule``
subclasses torch's (a public class; nothing of torch is changed) and overrides every method
torch's defines, private ones included, so that none of torch's methods, which reach for
torch's private per-module state, is ever run on our modules; ``test_engine_contract.py``
fails if torch adds one we do not override. A ``fully_shard`` module's class is
``FSDP<Orig>(FSDPModule, <Orig>)``: our class comes first, torch's second, the original third
(torch's own ``_orig_cls_mro_index`` convention, which ``ReplicateModule`` uses the same way).
A base class's method is reached past torch's with ``super(TorchFSDPModule, self)``.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle
from torch.distributed.fsdp import (
    register_fsdp_forward_method as torch_register_fsdp_forward_method,
)

from fsdp_engine._private.comm_settings import (
    check_no_custom_comm_for_allocation,
    check_symm_mem_for_comm,
    configure_separate_reduce_scatter_groups,
)
from fsdp_engine._private.module_states import prefetch_states, state_of, states_under
from fsdp_engine._private.state import FSDPState, get_state

__all__ = ["FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` completes the all-gathers
    and registers the unsharded parameters."""

    def __init__(self, state: FSDPState | None) -> None:
        self._state = state

    def wait(self) -> None:
        state, self._state = self._state, None
        for group in state.groups if state is not None else ():
            group.wait_for_unshard()
            group.register_unsharded()


class FSDPModule(TorchFSDPModule):
    """Mixed into the class of every module ``fully_shard`` was applied to (like FSDP2); one of
    torch's ``FSDPModule``s for ``isinstance`` ([Note: one of torch's FSDPModules])."""

    # FSDP<Orig> -> FSDPModule (ours) -> FSDPModule (torch's) -> Orig
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # A container's slicing (``layers[1:]``) builds ``type(self)(...)``: build the original
        # class, like FSDP2 (the new container is not a fully_shard module).
        orig: Any = cls.__mro__[cls._orig_cls_mro_index]
        self = orig.__new__(orig)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # FSDP2's answer: the copy would share (or lose) the flat storage and its hooks
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization."
        )

    def _engine_state(self) -> FSDPState:
        return state_of(self, "fully_shard")

    def _get_fsdp_state(self) -> Any:
        """The module's state (ours: torch's ``register_fsdp_forward_method`` applied to our
        module calls its ``_pre_forward``/``_post_forward``, which ours has alike)."""
        state = get_state(self) if isinstance(self, nn.Module) else None
        if state is None:
            raise AssertionError(f"No FSDP state found on {self}")
        return state

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's private switch to issue the pre-forward/pre-backward all-gathers with
        ``async_op=True`` so their buffers are allocated on the default stream. The engine's
        all-gathers write persistent planned storage (no allocation to place): validated, no
        effect."""
        if not isinstance(async_op, bool):
            raise TypeError(f"async_op must be a bool, got {type(async_op).__name__}")
        states_under(self, True)

    def _configure_groups(self, recurse: bool, **changes: Any) -> None:
        for state in states_under(self, recurse):
            for group in state.groups:
                group.configure(**changes)

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

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones. Not recursive."""
        for group in self._engine_state().groups:
            group.reshard()

    def shard_plan(self) -> Any:
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

    def shard_plans(self) -> list[Any]:
        """One plan per dtype group of this module, in the order the dtypes first appear."""
        return [group.plan for group in self._engine_state().groups]

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward: wait for or drop every collective in
        flight, reshard, and return every state to idle (the failed iteration's gradients,
        including accumulated ones, are dropped). Call it on the root."""
        state = self._engine_state()
        if state.is_root is False:
            raise RuntimeError("reset_iter_state must be called on the root FSDP module")
        state.reset_iteration()

    # -- state settings -----------------------------------------------------------------------
    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """``False``: accumulate gradients locally (no reduce-scatter, in ``reduce_dtype``)
        until set back."""
        for state in states_under(self, recurse):
            state.configure(requires_gradient_sync=requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: ``False`` reduce-scatters each microbatch but holds the result (reduce dtype,
        the shard's size) without the replica all-reduce; the next backward with ``True`` adds
        it before its all-reduce, so the all-reduce runs once per window ([Note: reduction
        strategies]). No effect on a 1-D mesh (FSDP2's rule)."""
        self._configure_groups(recurse, requires_all_reduce=requires_all_reduce)

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        for state in states_under(self, recurse):
            state.configure(reshard_after_backward=reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` at runtime (e.g. ``True`` on the root, or ``False``
        for evaluation). Explicit, so it also applies to the root."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for state in states_under(self, recurse):
            state.configure(reshard_after_forward=reshard_after_forward)
            for group in state.groups:
                group.configure(post_forward_k=0)

    def set_modules_to_forward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """All-gather these modules' parameters asynchronously when this module's forward
        starts."""
        targets = prefetch_states("set_modules_to_forward_prefetch", modules)
        self._engine_state().configure(forward_prefetch=targets)

    def set_modules_to_backward_prefetch(self, modules: list[TorchFSDPModule]) -> None:
        """All-gather these modules' parameters asynchronously when this module's backward starts
        (default: the module that ran forward just before this one)."""
        targets = prefetch_states("set_modules_to_backward_prefetch", modules)
        self._engine_state().configure(backward_prefetch=targets)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """``False``: do not all-gather this module's parameters in backward (when its backward
        does not read them, e.g. an embedding); gradients are still reduced."""
        self._engine_state().configure(unshard_in_backward=unshard_in_backward)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """``False``: the next backward does not wait for its gradient reductions (they are
        waited at the next forward)."""
        self._engine_state().ctx.is_last_backward = is_last_backward

    def set_post_optim_event(self, event: torch.Event) -> None:
        """An event recorded after the optimizer step: the root's next pre-forward makes the
        current stream wait on it (accelerators) before the all-gathers; discarded after use."""
        self._engine_state().ctx.post_optim_event = event

    # -- group settings -----------------------------------------------------------------------
    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide gradients by ``factor`` instead of averaging over the data-parallel ranks
        (FSDP2's arithmetic: dbuffer's [Note: dividing a mean of gradients])."""
        if factor <= 0:
            raise ValueError(f"divide factor must be > 0, got {factor}")
        self._configure_groups(False, reduce_divide_factor=float(factor))

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of ``set_gradient_divide_factor`` (as in FSDP2, with its warning)."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only SUM collectives: the mean's division runs before/after them."""
        self._configure_groups(False, reduce_force_sum=bool(enable))

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """fsdp_engine always reduces every trainable parameter of a group, unused ones as zeros
        ([Note: conditional compute]), so ranks that use different parameters never issue
        mismatched collectives, whatever this says; every trainable parameter of a reduced
        group keeps a ``.grad`` (``True``, the engine's default). ``False``: parameters no rank
        used lose their ``.grad`` (as with one process, or DDP's ``find_unused_parameters``),
        at the cost of one small all-reduce per backward ([Note: gradient presence])."""
        self._configure_groups(recurse, exact_presence=not reduce_scatter_unused_params)

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """How many reductions may be in flight at once ([Note: reductions in flight]): each
        holds its group's unsharded gradient storage until it completes. 1 (the default) waits
        for the previous reduction before the next is issued."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}"
            )
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        self._configure_groups(recurse, max_input_buffers=max_input_buffers)

    def set_gradients_in_parameter_storage(self, enabled: bool, *, recurse: bool = True) -> None:
        """Beyond FSDP2 (opt-in): on a backward that reduces and reshards, each gradient
        overwrites its own unsharded parameter once autograd has accumulated it, and the
        reduce-scatter reads that storage: a layer's gradients are never held beside its
        parameters, lowering a parameter-bound backward's peak by one layer's gradients.
        Sound unless the model reads a detached alias of a weight (``w.detach()``, or a
        ``no_grad`` computation saved for backward) later in the backward than the weight's
        gradient; applies to groups whose compute, parameter and reduce dtypes agree (no
        mixed precision) ([Note: gradients in the parameters' storage])."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._configure_groups(recurse, gradients_in_place=enabled)

    def set_check_finite_gradients(self, enabled: bool, *, recurse: bool = True) -> None:
        """Beyond FSDP2 (opt-in): each backward that reduces checks every rank's gradient norm
        before the reduction and raises ``NonFiniteGradientError`` from ``backward()`` on every
        rank when one is NaN or inf, naming the rank(s), the module(s) and the first parameter
        with a non-finite gradient (FSDP2 averages it into every rank's gradients silently).
        Costs one norm per group and one small all-reduce and host read per backward when on;
        call it with the same value on every rank ([Note: a non-finite gradient, named])."""
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
        self._configure_groups(recurse, reduce_check_finite=enabled)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: torch.Stream | None = None
    ) -> None:
        """``hook(reduce_output)`` runs on each group's reduced gradient shard (reduce dtype),
        after the replica all-reduce with HSDP, before it is written to ``.grad``; on
        ``stream`` (only without native HSDP), ordered after the reduction and before the
        gradient is used."""
        for group in self._engine_state().groups:
            if stream is not None and group.mesh.ndim > 1:
                raise ValueError("stream cannot be set when using native HSDP")
        self._configure_groups(False, reduce_hook=hook, reduce_hook_stream=stream)

    def set_custom_all_gather(self, comm: Any) -> None:
        """Replace the all-gather: ``comm(output_tensor=, input_tensor=, group=, async_op=)`` is
        called with the group's own flat buffers, on the all-gather stream (its ``allocate`` is
        not used: the output is the group's planned unsharded storage)."""
        self._configure_groups(False, all_gather_comm=comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Replace the reduce-scatter: ``comm(output_tensor=, input_tensor=, group=, op=,
        async_op=)`` on the reduce-scatter stream; its ``allocate(size, dtype=, device=)``, when
        it has one, makes the receive buffer."""
        allocate = getattr(comm, "allocate", None)
        self._configure_groups(
            False,
            reduce_comm=comm,
            reduce_allocate=allocate if callable(allocate) else None,
        )

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2 allocates its staging buffers from the process group's allocator. The engine
        has no staging buffers (collectives read and write the planned persistent storage), so
        this changes nothing; like FSDP2 it cannot be combined with a custom collective."""
        check_no_custom_comm_for_allocation(self._engine_state().groups)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """``True``: the reduce-scatters run on a process group of their own over the shard
        ranks (``dist.new_group(..., use_local_synchronization=True)``, one per distinct set of
        shard ranks in this call), so they do not share a communicator with the all-gathers;
        ``False``: back to the mesh's group. Collective over the shard ranks, as in FSDP2."""
        groups = [group for state in states_under(self, recurse) for group in state.groups]
        configure_separate_reduce_scatter_groups(groups, enable)

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """FSDP2 allocates its all-gather staging buffers from symmetric memory (NCCL). The
        engine has no staging buffers: each all-gather writes the group's planned persistent
        unsharded storage, and the reduce-scatter reads the gradient storage. So, like
        ``set_allocate_memory_from_process_group_for_comm``, this is validated as FSDP2
        validates it (the ``"NCCL"`` backend; not with a custom collective) and changes
        nothing."""
        check_symm_mem_for_comm(self._engine_state().groups, backend)

    def to_empty(self, *, device: Any, recurse: bool = True) -> Any:
        """``nn.Module.to_empty``: the managed parameters' storage is reserved on ``device``
        without being written ([Note: meta-device parameters]); their values are undefined until
        initialized or loaded, as with torch's ``to_empty``."""
        states = states_under(self, recurse)
        for state in states:
            for group in state.groups:
                group.values_undefined = True
        try:
            return super().to_empty(device=device, recurse=recurse)  # type: ignore[misc]
        finally:
            for state in states:
                for group in state.groups:
                    group.values_undefined = False

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # ``.to(dtype)``, ``.float()``, ``to_empty`` replace or re-type the sharded parameters'
        # local tensors: adopt what they became into our storage (children do their own).
        state = self._engine_state()
        for group in state.groups:
            group.to_sharded()
        # past torch's FSDPModule._apply (which reaches for torch's state) to the original class
        ret = super(TorchFSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]
        for group in state.groups:
            group.reset_after_apply()
        return ret


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard/reshard like ``forward`` (FSDP2's function); a no-op
    for modules that are not fully_shard modules. A module torch's own ``fully_shard`` manages
    gets torch's function (code that mixes both keeps working)."""
    if not isinstance(module, FSDPModule):
        if isinstance(module, TorchFSDPModule):
            torch_register_fsdp_forward_method(module, method_name)
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
    communication streams are already one per device and kind, shared by every module: this
    validates the list and changes nothing."""
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")
