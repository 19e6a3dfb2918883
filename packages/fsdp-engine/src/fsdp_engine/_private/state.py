"""Per-module state and hooks: unshard before forward, reshard after, reduce after backward.

[Note: the life of a step]
- pre-forward: the root lazily initialises every state in its subtree; the groups all-gather
  (waiting on a prefetch if one was issued) and their unsharded parameters are registered; the
  module's forward inputs that require grad pass through ``PostBackwardFunction``, whose backward
  is this module's post-backward; modules named by ``set_modules_to_forward_prefetch`` start their
  all-gathers asynchronously.
- post-forward: ``reshard_after_forward`` frees the unsharded storage and re-registers the sharded
  parameters; a hook on the outputs' gradients is this module's pre-backward.
- pre-backward (the outputs' gradients are being computed): all-gather again if needed, attach the
  unsharded gradient storage, prefetch the previous module of the forward order.
- post-backward, the one place that decides when a group reduces: when autograd has computed the
  gradients of the module's forward inputs, i.e. after the module's whole backward, the groups
  reduce-scatter (async, at most one reduction in flight) and reshard. It never depends on which
  parameters received a gradient on this rank ([Note: conditional compute] in group.py), so the
  collective order is the same on every rank by construction.
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
import functools
from collections.abc import Callable, Sequence
from typing import Any, ParamSpec, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd import Variable

from fsdp_engine._private.compat import PostBackwardFunction, apply_to_tensors, in_backward
from fsdp_engine._private.group import ParamGroup, ShardState
from fsdp_engine._private.policy import MixedPrecisionPolicy

__all__ = ["FSDPState", "TrainingState", "get_state"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _hidden_from_dynamo(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """[Note: hooks and torch.compile]
    The hooks run eagerly, outside any graph dynamo builds of a module that ``fully_shard``
    manages (``module.compile()``), as FSDP2's do: their collectives and Python bookkeeping
    would otherwise break the graph (one break per layer, at the all-gather) or be traced into
    it. Eager calls go straight to ``fn`` (no per-call wrapper cost, dynamo is not imported);
    while dynamo traces, the call is to ``torch._dynamo.disable(fn)``, which dynamo runs
    outside the graph without splitting it."""

    @functools.wraps(fn)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():
            disable = torch._dynamo.disable  # untyped in torch
            hidden: Callable[_P, _R] = disable(  # type: ignore[no-untyped-call]
                fn, recursive=True, reason="fsdp_engine hooks"
            )
            return hidden(*args, **kwargs)
        return fn(*args, **kwargs)

    return run


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class IterationContext:
    """What the states of one root share: set up by the root's lazy init."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []  # the root's subtree, modules() pre-order
        self.iter_forward_root: FSDPState | None = None
        self.post_forward_order: list[FSDPState] = []  # with multiplicity, this iteration
        self.final_callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: torch.Event | None = None
        self.last_reduced: ParamGroup | None = None  # at most one reduction in flight
        # [Note: implicit forward prefetch]
        self.pre_forward_order: list[FSDPState] = []  # this iteration, with multiplicity
        self.forward_next: dict[int, list[FSDPState | None]] = {}  # last iteration's successors
        self.forward_seen: dict[int, int] = {}  # occurrences of each state so far


class FSDPState:
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
        # ``None``: True, except that the root keeps its parameters after forward (lazy init)
        self.auto_reshard_after_forward = reshard_after_forward is None
        self.reshard_after_forward = (
            True if reshard_after_forward is None else reshard_after_forward
        )
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.unshard_in_backward = True
        self.mp_policy = mp_policy
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.ctx = IterationContext()
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._post_forward_indices: list[int] = []
        self._modules_to_run: set[int] = set()  # a list of modules: those yet to run forward
        self._hooks: list[Any] = []
        owners = {id(r.owner): r.owner for g in self.groups for r in g.refs}
        for owner in owners.values():
            # state_dict()/load_state_dict() always see the sharded parameters, even right after
            # a forward that left them unsharded (the root, or reshard_after_forward=False)
            on_save = owner.register_state_dict_pre_hook  # untyped in torch
            on_load = owner._register_load_state_dict_pre_hook
            self._hooks.append(on_save(self._to_sharded_hook))  # type: ignore[no-untyped-call]
            self._hooks.append(on_load(self._to_sharded_hook))  # type: ignore[no-untyped-call]
        for module in self.modules:
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            )
            self._hooks.append(module.register_forward_hook(self._post_forward, prepend=False))

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
        if self.is_root is not None:
            return
        if len(self.modules) > 1:
            names = ", ".join(type(m).__name__ for m in self.modules)
            raise RuntimeError(
                f"FSDP requires a single root module but got a fully_shard group of several "
                f"modules ({names}) as the first to run forward; fully_shard their parent"
            )
        self.is_root = True
        self.root = self
        root_module = self.modules[0]
        ctx = self.ctx
        for name, module in root_module.named_modules():
            state = get_state(module)
            if state is None or state in ctx.all_states:
                continue
            if state is not self:
                if state.is_root is not None:
                    raise RuntimeError(
                        f"fully_shard state has already been lazily initialized for {name!r}; "
                        "fully_shard requires running forward through the root module first"
                    )
                state.is_root = False
                state.root = self
            ctx.all_states.append(state)
        for state in ctx.all_states:
            state.ctx = ctx
        if self.auto_reshard_after_forward:
            # the root's parameters are needed again at the start of backward
            self.reshard_after_forward = False
        fqns = {id(p): n for n, p in root_module.named_parameters(remove_duplicate=False)}
        for state in ctx.all_states:
            for group in state.groups:
                group.to_sharded()
        for state in ctx.all_states:
            meta = [
                fqns.get(id(g.sharded[i]), g.refs[i].fqn)
                for g in state.groups
                for i in g.meta_indices()
            ]
            if meta:
                raise RuntimeError(
                    "FSDP parameters should be materialized from meta device before training, "
                    f"but the following were still on meta device: {meta}"
                )

    # -- forward -----------------------------------------------------------------------------
    @_hidden_from_dynamo
    def _pre_forward(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if self.training_state is TrainingState.PRE_BACKWARD:
            # activation-checkpoint recompute of this module inside its backward
            for group in self.groups:
                group.unshard()
                group.register_unsharded()
            return self._cast_inputs(args, kwargs)
        first_in_pass = self.training_state is not TrainingState.FORWARD
        if first_in_pass:
            self.lazy_init()
            self._root_pre_forward()
            self.training_state = TrainingState.FORWARD
            if len(self.modules) > 1:
                self._modules_to_run = {id(m) for m in self.modules}
        args, kwargs = self._cast_inputs(args, kwargs)
        for group in self.groups:
            group.wait_for_reduce()
            group.release_dropped_gradients()
            group.unshard()
            group.register_unsharded()
        if first_in_pass:
            args, kwargs = self._register_post_backward(args, kwargs)
            for other in self._forward_prefetch_targets():
                for group in other.groups:
                    group.unshard(async_op=True)
        return args, kwargs

    def _forward_prefetch_targets(self) -> Sequence[FSDPState]:
        """[Note: implicit forward prefetch]
        Without ``set_modules_to_forward_prefetch``, the module that ran forward after this one
        in the previous iteration (the same occurrence of this module) is all-gathered now,
        asynchronously, right after this module's own all-gather and before its compute: the
        next group's communication overlaps this group's compute on every backend (gloo runs it
        on its own threads; on accelerators it runs on the all-gather stream, which waits only
        for the shards' last write and for memory to be free, not for this compute). FSDP2 issues
        that all-gather in the next module's pre-forward, after this compute was issued; ours is
        issued earlier, deliberately (the issue-order test documents it). The order is the one
        every rank ran (FSDP's contract: the same modules in the same order on every rank), so
        the collective order stays identical on every rank. A prediction that does not come true
        (the order changed) costs one unused all-gather, freed at the end of the forward. The
        first iteration has no previous order: no prefetch, like FSDP2 on CPU."""
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        ctx = self.ctx
        if in_backward():
            return ()
        occurrence = ctx.forward_seen.get(id(self), 0)
        ctx.forward_seen[id(self)] = occurrence + 1
        ctx.pre_forward_order.append(self)
        successors = ctx.forward_next.get(id(self), [])
        target = successors[occurrence] if occurrence < len(successors) else None
        if target is None or target is self or not target.groups:
            return ()
        return (target,)

    def _cast_inputs(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        dtype = self.mp_policy.param_dtype
        if not (self.mp_policy.cast_forward_inputs and dtype is not None):
            return args, kwargs
        cast = apply_to_tensors(lambda x: _cast(x, dtype), (args, kwargs))
        return tuple(cast[0]), dict(cast[1])

    def _root_pre_forward(self) -> None:
        """Once per iteration, by the first state to run forward (normally the root)."""
        ctx = self.ctx
        if in_backward() or ctx.iter_forward_root is not None:
            return
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
            self._start_forward_order()
            ready = _event_now(ctx.all_states)
            for state in ctx.all_states:
                for group in state.groups:
                    group.inputs_ready = ready

    def _start_forward_order(self) -> None:
        """Root, new iteration: the last iteration's pre-forward order becomes the prediction
        ([Note: implicit forward prefetch]), and a new one is recorded."""
        ctx = self.ctx
        if ctx.pre_forward_order:
            order = ctx.pre_forward_order
            nxt: dict[int, list[FSDPState | None]] = {}
            for i, state in enumerate(order):
                nxt.setdefault(id(state), []).append(order[i + 1] if i + 1 < len(order) else None)
            ctx.forward_next = nxt
        ctx.pre_forward_order = []
        ctx.forward_seen = {}

    def _register_post_backward(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Route the forward inputs that require grad through ``PostBackwardFunction``: its
        backward (this module's post-backward) runs once their gradients are computed."""
        if not torch.is_grad_enabled() or not self.groups:
            return args, kwargs
        found: list[torch.Tensor] = []

        def collect(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                found.append(t)
            return t

        apply_to_tensors(collect, (args, kwargs))
        if not found:
            return args, kwargs
        outputs = iter(PostBackwardFunction.apply(self, *found))

        def replace(t: torch.Tensor) -> torch.Tensor:
            return next(outputs) if t.requires_grad else t

        new = apply_to_tensors(replace, (args, kwargs))
        return tuple(new[0]), dict(new[1])

    @_hidden_from_dynamo
    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return self._cast_output(output)  # recompute: the post-backward reshards
        if self._modules_to_run:
            self._modules_to_run.discard(id(module))
            if self._modules_to_run:
                return self._cast_output(output)  # the group's other modules are still to run
        output = self._finish_forward(output)
        ctx = self.ctx
        if ctx.iter_forward_root is self:
            ctx.iter_forward_root = None
            for state in reversed(ctx.all_states):
                if state is not self and state._modules_to_run:
                    # a group of several modules whose forward ran only some of them
                    state._modules_to_run.clear()
                    output = state._finish_forward(output)
            ran = {id(s) for s in ctx.pre_forward_order}
            for state in ctx.all_states:
                if id(state) not in ran and state is not self:
                    for group in state.groups:
                        if group.unshard_handle is not None and group.state is ShardState.SHARDED:
                            group.reshard()  # a forward prefetch that did not come true
            if not torch.is_grad_enabled():  # no backward of this forward
                for state in ctx.all_states:
                    for group in state.groups:
                        group.inputs_ready = None
        return self._cast_output(output)

    def _finish_forward(self, output: Any) -> Any:
        if not in_backward():
            for group in self.groups:
                if self.reshard_after_forward is True or (
                    group.subgroup is not None and not torch.is_grad_enabled()
                ):
                    group.reshard()
                elif group.subgroup is not None:
                    group.reshard_to_subgroup()
            if torch.is_grad_enabled():  # the backward prefetch order
                ctx = self.ctx
                self._post_forward_indices.append(len(ctx.post_forward_order))
                ctx.post_forward_order.append(self)
        self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            for tensor in _grad_tensors(output):
                tensor.register_hook(self._pre_backward)  # type: ignore[no-untyped-call]
        return output

    def _cast_output(self, output: Any) -> Any:
        dtype = self.mp_policy.output_dtype
        if dtype is None:
            return output
        return apply_to_tensors(lambda x: _cast(x, dtype), output)

    # -- backward ----------------------------------------------------------------------------
    @_hidden_from_dynamo
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.training_state is TrainingState.PRE_BACKWARD:
            return grad  # another output of the same forward
        self.training_state = TrainingState.PRE_BACKWARD
        ctx = self.ctx
        root = self.root or self
        if not ctx.final_callback_queued:
            ctx.final_callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)
        for group in self.groups:
            if self.unshard_in_backward:
                group.unshard()
                group.register_unsharded()
            group.prepare_gradients()
        for other in self._backward_prefetch_targets():
            for group in other.groups:
                group.unshard(async_op=True)
        return grad

    def _backward_prefetch_targets(self) -> Sequence[FSDPState]:
        if self.backward_prefetch is not None:
            return [s for s in self.backward_prefetch if s.unshard_in_backward]
        if not self._post_forward_indices:
            return []
        index = self._post_forward_indices.pop()
        if index == 0:
            return []
        target = self.ctx.post_forward_order[index - 1]
        return [target] if target.unshard_in_backward else []

    @_hidden_from_dynamo
    def post_backward(self, *unused: Any) -> None:
        """This module's post-backward: reduce (or accumulate) and reshard every group. Safe to
        call when the module took no part in backward (nothing to reduce)."""
        self.training_state = TrainingState.POST_BACKWARD
        ctx = self.ctx
        for group in self.groups:
            if self.requires_gradient_sync:
                # at most one reduction in flight: waiting the previous one frees its unsharded
                # gradients before this group's are handed over
                previous = ctx.last_reduced
                if previous is not None and previous is not group:
                    previous.wait_for_reduce()
                group.reduce(sync=True, async_op=True)
                ctx.last_reduced = group
            else:
                group.reduce(sync=False, async_op=False)
            if self.reshard_after_backward and group.state is ShardState.UNSHARDED:
                group.reshard()

    def _final_callback(self) -> None:
        """Root only: runs once when the whole backward pass has finished."""
        ctx = self.ctx
        for state in ctx.all_states:
            if state.training_state is not TrainingState.POST_BACKWARD:
                state.post_backward()  # inputs that need no gradient: no autograd post-backward
            state.training_state = TrainingState.IDLE
            state._modules_to_run.clear()
            for group in state.groups:
                if group.unshard_handle is not None and group.state is ShardState.SHARDED:
                    group.reshard()  # a prefetch nobody used (a mistargeted backward prefetch)
        _resolve_presence([g for state in ctx.all_states for g in state.groups])
        if ctx.is_last_backward:
            for state in ctx.all_states:
                for group in state.groups:
                    group.wait_for_reduce()
            ctx.post_forward_order.clear()
            for state in ctx.all_states:
                state._post_forward_indices.clear()
        ctx.final_callback_queued = False
        ctx.last_reduced = None
        ctx.iter_forward_root = None
        for state in ctx.all_states:
            for group in state.groups:
                group.inputs_ready = None

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
        ctx.iter_forward_root = None
        ctx.final_callback_queued = False
        ctx.last_reduced = None
        ctx.pre_forward_order = []
        ctx.forward_seen = {}
        for state in ctx.all_states:
            for group in state.groups:
                group.inputs_ready = None


def _event_now(states: Sequence[FSDPState]) -> torch.Event | None:
    """An event on the current stream of the states' accelerator (None on CPU): what every
    all-gather of this iteration waits for (the optimizer's writes are before it)."""
    for state in states:
        for group in state.groups:
            device = group.params.device
            if device.type in {"cpu", "meta"}:
                return None
            event = torch.Event(device=device)
            event.record(torch.accelerator.current_stream(device))
            return event
    return None


def _resolve_presence(groups: Sequence[ParamGroup]) -> None:
    """Exact gradient presence ([Note: gradient presence] in group.py): one all-reduce of
    every waiting group's used-flags per mesh (per mesh axis), in a fixed order. Every rank
    takes part: a group's presence is due on every rank or none (it follows its reduction)."""
    by_mesh: dict[int, list[tuple[ParamGroup, torch.Tensor]]] = {}
    for group in groups:
        flags = group.presence_flags()
        if flags is not None:
            by_mesh.setdefault(id(group.mesh), []).append((group, flags))
    for entries in by_mesh.values():
        mesh = entries[0][0].mesh
        total = torch.cat([flags for _, flags in entries])
        for axis in range(mesh.ndim):
            if mesh.size(axis) > 1:
                dist.all_reduce(total, group=mesh.get_group(axis))
        offset = 0
        for group, flags in entries:
            group.apply_presence(total[offset : offset + flags.numel()])
            offset += flags.numel()


def _grad_tensors(output: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            found.append(t)
        return t

    apply_to_tensors(collect, output)
    return found


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


STATE_ATTR = "_fsdp_engine_state"


def get_state(module: nn.Module) -> FSDPState | None:
    state = module.__dict__.get(STATE_ATTR)
    assert state is None or isinstance(state, FSDPState)
    return state
