"""Per-module state and hooks: unshard before forward, reshard after, reduce after backward.

[Note: the life of a step]
- pre-forward: the root lazily initialises every state in its subtree; the groups all-gather
  (waiting on a prefetch if one was issued) and their unsharded parameters are registered; the
  module's forward inputs that require grad pass through ``PostBackwardFunction``, whose backward
  is this module's post-backward; modules named by ``set_modules_to_forward_prefetch`` (or the
  predicted next one: [Note: implicit forward prefetch]) start their all-gathers asynchronously.
- post-forward: ``reshard_after_forward`` frees the unsharded storage and re-registers the sharded
  parameters; a hook on the outputs' gradients is this module's pre-backward.
- pre-backward (the outputs' gradients are being computed): all-gather again if needed, attach the
  unsharded gradient storage, prefetch the previous module of the forward order.
- post-backward, the one place that decides when a group reduces: when autograd has computed the
  gradients of the module's forward inputs, i.e. after the module's whole backward, the groups
  reduce-scatter (async, [Note: reductions in flight]) and reshard. It never depends on which
  parameters received a gradient on this rank ([Note: conditional compute]), so the collective
  order is the same on every rank by construction.
- the root's final callback, queued by the first pre-backward, runs the post-backward of every
  state that has not had one (modules whose inputs need no gradient, e.g. the embedding taking
  token ids) in one fixed order, waits for the reductions and returns every state to IDLE.

[Note: training states]
``IDLE -> FORWARD -> IDLE -> PRE_BACKWARD -> POST_BACKWARD -> IDLE``. A forward that starts while
the state is PRE_BACKWARD is an activation-checkpoint recompute of this module (reentrant or not,
``checkpoint_wrapper``, composable ``checkpoint``): it only makes sure the parameters are
unsharded and registered, and its post-forward does nothing. Any forward that runs inside a
backward (a nested module recomputed there) never reshards after forward and never starts or
resets an iteration, so recomputation sees the parameters its backward needs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from fsdp_engine._private import compat
from fsdp_engine._private.api import MixedPrecisionPolicy
from fsdp_engine._private.hooks import (
    cast_inputs,
    cast_output,
    grad_tensors,
    hidden_from_dynamo,
    offset_free_entries,
    register_post_backward,
)
from fsdp_engine._private.iteration import (
    IterationContext,
    backward_prefetch_targets,
    forward_prefetch_targets,
    iteration_event,
)
from fsdp_engine._private.param_group import ParamGroup
from fsdp_engine._private.pipelining import PipelineStageNames
from fsdp_engine._private.presence import resolve_presence
from fsdp_engine._private.root_init import init_root
from fsdp_engine._private.runtime_checks import check_finite_gradients, check_microbatch_agreement
from fsdp_engine._private.trace import logger, traced, warn_view_output, with_fqn

__all__ = ["STATE_ATTR", "FSDPState", "StateConfig", "TrainingState", "get_state"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


@attrs.frozen
class StateConfig:
    """What ``FSDPModule``'s setters configure on a state (``FSDPState.configure``).
    ``reshard_after_forward=None``: True, except that the root keeps its parameters after
    forward (decided at lazy init)."""

    reshard_after_forward: bool | None = None
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    unshard_in_backward: bool = True
    forward_prefetch: tuple[FSDPState, ...] | None = None
    backward_prefetch: tuple[FSDPState, ...] | None = None


class FSDPState(PipelineStageNames):
    """What ``fully_shard`` attaches to a module (``module._fsdp_engine_state``)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        groups: Sequence[ParamGroup],
        *,
        reshard_after_forward: bool | None,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        # one state per fully_shard call; a list of modules shares its groups and its state
        self.modules = tuple(modules)
        self.module = self.modules[0]
        self.groups = tuple(groups)
        self.config = StateConfig()
        self.configure(reshard_after_forward=reshard_after_forward)
        self.mp_policy = mp_policy
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.fqn: str | None = None  # the module's name under the root ([Note: FSDP2's trace])
        self.ctx = IterationContext()
        self._post_forward_indices: list[int] = []
        self._modules_to_run: set[int] = set()  # a list of modules: those yet to run forward
        self._hooks: list[Any] = []
        owners = {id(r.owner): r.owner for g in self.groups for r in g.refs}
        for owner in owners.values():
            # state_dict()/load_state_dict() always see the sharded parameters, even right after
            # a forward that left them unsharded (the root, or reshard_after_forward=False)
            on_save = owner.register_state_dict_pre_hook  # untyped in torch
            self._hooks.append(on_save(self._to_sharded_hook))  # type: ignore[no-untyped-call]
            on_load = owner.register_load_state_dict_pre_hook  # untyped in torch
            self._hooks.append(on_load(self._to_sharded_hook))  # type: ignore[no-untyped-call]
        places = {
            id(m): m for g in self.groups for r in g.refs for m, _ in ((r.owner, 0), *r.aliases)
        }
        for place in places.values():
            # the saved DTensors pickle like FSDP2's ([Note: DTensors over views] in compat)
            saved = place.register_state_dict_post_hook  # untyped in torch
            self._hooks.append(saved(offset_free_entries))  # type: ignore[no-untyped-call]
        for module in self.modules:
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            )
            self._hooks.append(module.register_forward_hook(self._post_forward, prepend=False))

    def configure(self, **changes: Any) -> None:
        """The one entry for ``FSDPModule``'s state setters (``StateConfig`` fields); the
        groups get the fields their lifecycle reads ([Note: the group's lifecycle])."""
        self.config = attrs.evolve(self.config, **changes)
        pushed = {k: v for k, v in changes.items() if k in _GROUP_FIELDS}
        if "reshard_after_forward" in pushed:
            pushed["reshard_after_forward"] = pushed["reshard_after_forward"] is not False
        if pushed:
            for group in self.groups:
                group.configure(**pushed)

    @property
    def reshard_after_forward(self) -> bool:
        return self.config.reshard_after_forward is not False

    @property
    def group(self) -> ParamGroup | None:
        """The one group of this state (None when it manages no parameters); a call whose
        parameters have several dtypes has one group per dtype: use ``groups``."""
        if len(self.groups) > 1:
            raise RuntimeError(
                f"this fully_shard call holds {len(self.groups)} groups (one per dtype: "
                f"{[str(g.dtype) for g in self.groups]}); iterate FSDPState.groups"
            )
        return self.groups[0] if self.groups else None

    def _to_sharded_hook(self, *args: Any, **kwargs: Any) -> None:
        if self.training_state is TrainingState.IDLE:
            for group in self.groups:
                group.to_sharded()

    # -- lazy init ---------------------------------------------------------------------------
    def lazy_init(self) -> None:
        """The first state to run forward becomes the root of every state below it."""
        if self.is_root is None:
            init_root(self, get_state)

    # -- forward -----------------------------------------------------------------------------
    @hidden_from_dynamo
    def _pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.training_state is TrainingState.PRE_BACKWARD:
            # activation-checkpoint recompute of this module inside its backward
            for group in self.groups:
                group.pre_forward(recompute=True)
            return cast_inputs(self.mp_policy, args, kwargs)
        first_in_pass = self.training_state is not TrainingState.FORWARD
        if first_in_pass:
            self.lazy_init()
            self._root_pre_forward()
            self.training_state = TrainingState.FORWARD
            if len(self.modules) > 1:
                self._modules_to_run = {id(m) for m in self.modules}
        args, kwargs = cast_inputs(self.mp_policy, args, kwargs)
        with traced(self.label("FSDP::pre_forward"), log=bool(self.groups)):
            for group in self.groups:
                group.pre_forward()
            if first_in_pass:
                args, kwargs = register_post_backward(self, bool(self.groups), args, kwargs)
        if first_in_pass:
            for other in forward_prefetch_targets(self):
                with traced(f"FSDP::forward_prefetch for {other.fqn}", log=False):
                    for group in other.groups:
                        group.unshard_traced(async_op=True)
        return args, kwargs

    def label(self, name: str) -> str:
        """FSDP2's name of a step of this module ([Note: FSDP2's trace])."""
        return with_fqn(name, self.fqn)

    def _root_pre_forward(self) -> None:
        """Once per iteration, by the first state to run forward (normally the root)."""
        ctx = self.ctx
        if compat.in_backward() or ctx.iter_forward_root is not None:
            return
        with traced("FSDP::root_pre_forward"):
            self._start_iteration()

    def _start_iteration(self) -> None:
        ctx = self.ctx
        ctx.iter_forward_root = self
        event, ctx.post_optim_event = ctx.post_optim_event, None
        if event is not None and event.device is not None and event.device.type != "cpu":
            torch.accelerator.current_stream(event.device).wait_event(event)
        for state in ctx.all_states or [self]:
            for group in state.groups:
                group.wait_for_reduce()
        if self.is_root:  # a new iteration (not a standalone call of a submodule after forward)
            for state in ctx.all_states:
                state._post_forward_indices.clear()
            ctx.post_forward_order.clear()
            ctx.final_callback_queued = False
            ctx.start_forward_order()
            ctx.resolve_max_in_flight()
            ctx.inputs_ready = iteration_event(ctx.all_states)
            if torch.is_grad_enabled():  # a microbatch ([Note: microbatch agreement])
                ctx.microbatch += 1
                check_microbatch_agreement(self, "forward")

    @hidden_from_dynamo
    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return cast_output(self.mp_policy, output)  # recompute: the post-backward reshards
        if self._modules_to_run:
            self._modules_to_run.discard(id(module))
            if self._modules_to_run:
                return cast_output(
                    self.mp_policy, output
                )  # the group's other modules are still to run
        output = self._finish_forward(output)
        ctx = self.ctx
        if ctx.iter_forward_root is self:
            ctx.iter_forward_root = None
            for state in reversed(ctx.all_states):
                if state is not self and state._modules_to_run:
                    # a group of several modules whose forward ran only some of them
                    logger.debug("FSDP::force_complete_post_forward")
                    state._modules_to_run.clear()
                    output = state._finish_forward(output)
            ran = {id(s) for s in ctx.pre_forward_order}
            for state in ctx.all_states:
                if id(state) not in ran and state is not self:
                    state._drop_unused_prefetch()  # a forward prefetch that did not come true
            if not torch.is_grad_enabled():  # no backward of this forward
                ctx.inputs_ready = None
        return cast_output(self.mp_policy, output)

    def _drop_unused_prefetch(self) -> None:
        for group in self.groups:
            group.drop_prefetch()

    def _finish_forward(self, output: Any) -> Any:
        with traced(self.label("FSDP::post_forward"), log=bool(self.groups)):
            output = self._reshard_after_forward(output)
        self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            for tensor in grad_tensors(output):
                if compat.is_view(tensor):
                    warn_view_output(self.modules)
                tensor.register_hook(self._pre_backward)  # type: ignore[no-untyped-call]
        return output

    def _reshard_after_forward(self, output: Any) -> Any:
        """``reshard_after_forward`` and the backward prefetch order (not in a recompute inside
        backward)."""
        if not compat.in_backward():
            for group in self.groups:
                group.post_forward()
            if torch.is_grad_enabled():  # the backward prefetch order
                ctx = self.ctx
                self._post_forward_indices.append(len(ctx.post_forward_order))
                ctx.post_forward_order.append(self)
        return output

    # -- backward ----------------------------------------------------------------------------
    @hidden_from_dynamo
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad  # another output of the same forward
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        root = self.root or self
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            compat.queue_backward_callback(root._final_callback)
            check_microbatch_agreement(root, "backward")
        with traced(self.label("FSDP::pre_backward"), log=bool(self.groups)):
            for group in self.groups:
                group.pre_backward()
            for other in backward_prefetch_targets(self):
                with traced(f"FSDP::backward_prefetch for {other.fqn}", log=False):
                    for group in other.groups:
                        group.unshard_traced(async_op=True)
        return grad

    @hidden_from_dynamo
    def post_backward(self, *unused: Any) -> None:
        """This module's post-backward: reduce (or accumulate) and reshard every group. Safe to
        call when the module took no part in backward (nothing to reduce)."""
        if self.groups:
            logger.debug("%s", self.label("FSDP::post_backward"))
        self.training_state = TrainingState.POST_BACKWARD
        for group in self.groups:
            group.post_backward()

    def _final_callback(self) -> None:
        """Root only: runs once when the whole backward pass has finished."""
        logger.debug("FSDP::root_post_backward")
        with torch.profiler.record_function("FSDP::root_post_backward_callback"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        ctx = self.ctx
        for state in ctx.all_states:
            if state.training_state is not TrainingState.POST_BACKWARD:
                state.post_backward()  # inputs that need no gradient: no autograd post-backward
            state.training_state = TrainingState.IDLE
            state._modules_to_run.clear()
            state._drop_unused_prefetch()  # a mistargeted backward prefetch
        groups = [g for state in ctx.all_states for g in state.groups]
        resolve_presence(groups)
        if ctx.is_last_backward:
            for group in groups:
                group.finalize_backward()
            ctx.post_forward_order.clear()
            for state in ctx.all_states:
                state._post_forward_indices.clear()
        ctx.reset()
        if self.config.requires_gradient_sync:  # the accumulation window ends
            ctx.microbatch, ctx.windows = 0, ctx.windows + 1
        check_finite_gradients(ctx.all_states, self)  # opt-in: raises from backward()

    def reset_iteration(self) -> None:
        """Root only: recover after an exception in forward or backward (the failed
        iteration's gradients are dropped)."""
        ctx = self.ctx
        for state in ctx.all_states or [self]:
            for group in state.groups:
                group.discard_iteration()
            state.training_state = TrainingState.IDLE
            state._modules_to_run.clear()
            state._post_forward_indices.clear()
        ctx.post_forward_order.clear()
        ctx.pre_forward_order = []
        ctx.forward_seen = {}
        ctx.microbatch = 0  # the window's gradients were dropped: a new window starts
        ctx.reset()


STATE_ATTR = "_fsdp_engine_state"
# the StateConfig fields the groups' lifecycle reads (pushed by FSDPState.configure)
_GROUP_FIELDS = frozenset(
    {
        "requires_gradient_sync",
        "reshard_after_backward",
        "reshard_after_forward",
        "unshard_in_backward",
    }
)


def get_state(module: nn.Module) -> FSDPState | None:
    state = module.__dict__.get(STATE_ATTR)
    assert state is None or isinstance(state, FSDPState)
    return state
