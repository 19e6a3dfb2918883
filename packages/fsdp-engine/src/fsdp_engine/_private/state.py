"""Per-module state and hooks: unshard before forward, reshard after, reduce after backward.

[Note: the life of a step]
- pre-forward: the root lazily initialises every state in its subtree; the group all-gathers
  (waiting on a prefetch if one was issued) and its unsharded parameters are registered; modules
  named by ``set_modules_to_forward_prefetch`` start their all-gathers asynchronously.
- post-forward: ``reshard_after_forward`` frees the unsharded storage and re-registers the sharded
  parameters; a hook on the outputs' gradients is left for backward.
- pre-backward (the outputs' gradients are being computed): all-gather again if needed, attach the
  unsharded gradient storage, prefetch the next group of the backward order.
- each parameter's gradient accumulation is counted (``register_post_accumulate_grad_hook``); when
  the last one lands the group reduce-scatters at once (async), overlapping the rest of backward.
- the root's final callback, queued in its pre-backward, reduces groups whose parameters were not
  all used, waits for the reductions, and reshards everything.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_map

from fsdp_engine._private.group import ParamGroup, ShardState
from fsdp_engine._private.policy import MixedPrecisionPolicy

__all__ = ["FSDPState", "TrainingState"]


class TrainingState(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    PRE_BACKWARD = "pre_backward"
    POST_BACKWARD = "post_backward"


class FSDPState:
    """What ``fully_shard`` attaches to a module (``module._fsdp_engine_state``)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        group: ParamGroup | None,
        *,
        reshard_after_forward: bool | int,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        # one state per fully_shard call; a list of modules shares one group and one state
        self.modules = tuple(modules)
        self.module = self.modules[0]
        self.group = group
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.is_last_backward = True
        self.mp_policy = mp_policy
        self.training_state = TrainingState.IDLE
        self.is_root: bool | None = None
        self.root: FSDPState | None = None
        self.all_states: list[FSDPState] = []  # root only: every state in its subtree
        self.forward_order: list[FSDPState] = []  # root only: this step's forward order
        self.forward_prefetch: list[FSDPState] | None = None
        self.backward_prefetch: list[FSDPState] | None = None
        self._final_callback_queued = False
        self._pre_backward_done = False
        self.last_reduced: ParamGroup | None = None  # root only
        self._hooks: list[Any] = []
        if group is not None:
            for index, param in enumerate(group.unsharded_params()):
                if param.requires_grad:
                    hook = _make_accumulate_hook(self, index)
                    handle = param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
                    self._hooks.append(handle)
        if group is not None:
            # state_dict()/load_state_dict() always see the sharded parameters, even right after
            # a forward that left them unsharded (the root, or reshard_after_forward=False)
            for owner in {id(ref.owner): ref.owner for ref in group.refs}.values():
                on_save = owner.register_state_dict_pre_hook  # untyped in torch
                on_load = owner._register_load_state_dict_pre_hook
                self._hooks.append(on_save(self._to_sharded_hook))  # type: ignore[no-untyped-call]
                self._hooks.append(on_load(self._to_sharded_hook))  # type: ignore[no-untyped-call]
        for module in self.modules:
            self._hooks.append(
                module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
            )
            self._hooks.append(module.register_forward_hook(self._post_forward, prepend=False))

    def _to_sharded_hook(self, *args: Any, **kwargs: Any) -> None:
        group = self.group
        if group is not None and self.training_state is TrainingState.IDLE:
            group.reshard()

    # -- lazy init ---------------------------------------------------------------------------
    def _lazy_init(self) -> None:
        if self.is_root is not None:
            return
        self.is_root = True
        self.root = self
        for submodule in (m for top in self.modules for m in top.modules()):
            state = get_state(submodule)
            if state is None or state in self.all_states:
                continue
            if state is not self:
                if state.is_root:
                    raise RuntimeError(
                        "fully_shard: a module initialised as a root is nested in "
                        "another root; call the outermost module first"
                    )
                state.is_root = False
                state.root = self
            self.all_states.append(state)
        # The root's parameters are needed again at the start of backward: keep them unsharded
        # (FSDP2 does the same).
        self.reshard_after_forward = False

    # -- forward -----------------------------------------------------------------------------
    def _pre_forward(
        self,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self._lazy_init()
        root = self.root
        assert root is not None
        if self.is_root:
            self._root_pre_forward()
        root.forward_order.append(self)
        self.training_state = TrainingState.FORWARD
        group = self.group
        if group is not None:
            group.wait_for_reduce()
            group.release_dropped_gradients()
            group.unshard()
            group.register_unsharded()
        for other in self.forward_prefetch or ():
            if other.group is not None:
                other.group.unshard(async_op=True)
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            dtype = self.mp_policy.param_dtype
            args, kwargs = tree_map(lambda x: _cast(x, dtype), (args, kwargs))
        return args, kwargs

    def _root_pre_forward(self) -> None:
        for state in self.all_states:
            if state.group is not None:
                state.group.wait_for_reduce()
            state._pre_backward_done = False
        self.forward_order = []
        self._final_callback_queued = False

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        group = self.group
        if group is not None and self.reshard_after_forward:
            if group.subgroup is not None and torch.is_grad_enabled():
                group.reshard_to_subgroup()
            else:
                group.reshard()
        self.training_state = TrainingState.IDLE
        if torch.is_grad_enabled():
            self._register_pre_backward(output)
        if self.mp_policy.output_dtype is not None:
            dtype = self.mp_policy.output_dtype
            output = tree_map(lambda x: _cast(x, dtype), output)
        return output

    def _register_pre_backward(self, output: Any) -> None:
        tensors = [
            t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        for tensor in tensors:
            tensor.register_hook(self._pre_backward)  # type: ignore[no-untyped-call]

    # -- backward ----------------------------------------------------------------------------
    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self._pre_backward_done:
            return grad
        self._pre_backward_done = True
        root = self.root
        assert root is not None
        if not root._final_callback_queued:
            root._final_callback_queued = True
            Variable._execution_engine.queue_callback(root._final_callback)
        self.training_state = TrainingState.PRE_BACKWARD
        group = self.group
        if group is not None:
            group.unshard()
            group.prepare_gradients()
        for other in self._backward_prefetch_targets():
            if other.group is not None and not other._pre_backward_done:
                other.group.unshard(async_op=True)
        return grad

    def _backward_prefetch_targets(self) -> Sequence[FSDPState]:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        root = self.root
        assert root is not None
        order = root.forward_order
        if self in order:
            index = order.index(self)
            if index > 0:
                return [order[index - 1]]
        return []

    def _post_backward(self) -> None:
        group = self.group
        if group is None or self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        if self.requires_gradient_sync:
            # At most one reduction in flight: waiting the previous one frees its unsharded
            # gradients before this group's are handed over, so backward never holds every
            # layer's unsharded gradients at once.
            root = self.root
            assert root is not None
            previous = root.last_reduced
            if previous is not None and previous is not group:
                previous.wait_for_reduce()
            group.reduce_gradients(async_op=True)
            root.last_reduced = group
        if self.reshard_after_backward:
            group.reshard()

    def _final_callback(self) -> None:
        """Root only: runs once when the whole backward pass has finished."""
        for state in self.all_states:
            group = state.group
            if group is None:
                continue
            if state._pre_backward_done and state.training_state is not TrainingState.POST_BACKWARD:
                state._post_backward()  # some parameters were unused: reduce what there is
            if state.is_last_backward or self.is_last_backward:
                group.wait_for_reduce()
            if group.state is ShardState.UNSHARDED and state.reshard_after_backward:
                group.reshard()
            state.training_state = TrainingState.IDLE
            state._pre_backward_done = False
        self._final_callback_queued = False
        self.last_reduced = None


def _make_accumulate_hook(state: FSDPState, index: int) -> Callable[[torch.Tensor], None]:
    def hook(param: torch.Tensor) -> None:
        group = state.group
        assert group is not None
        if group.note_gradient(index):
            state._post_backward()

    return hook


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


STATE_ATTR = "_fsdp_engine_state"


def get_state(module: nn.Module) -> FSDPState | None:
    state = module.__dict__.get(STATE_ATTR)
    assert state is None or isinstance(state, FSDPState)
    return state
