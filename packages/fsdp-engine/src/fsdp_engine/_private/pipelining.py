"""What ``torch.distributed.pipelining`` calls on a ``fully_shard`` stage's state.

[Note: pipeline stages]
A ``PipelineStage`` over a ``fully_shard`` module runs every microbatch's backward through
autograd (so our pre- and post-backward hooks run as in any backward) after
``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)``: the gradients accumulate unsharded and the parameters stay
gathered between microbatches. After the last microbatch its ``REDUCE_GRAD`` action
(``PipelineStage.perform_reduce_grad``) sets the three back to ``True`` and runs FSDP2's
post-backward by hand::

    state = fully_shard.state(stage_module)
    for s in state._state_ctx.all_states:
        for g in s._fsdp_param_groups:
            g.post_backward()
    state._root_post_backward_final_callback()

These names are thin views of our lifecycle, not FSDP2's classes: ``_state_ctx`` is the root's
``IterationContext`` (its ``all_states`` are our states), a state's ``_fsdp_param_groups`` are
``StageGroup`` views whose ``post_backward`` is the state's post-backward (reduce what the
microbatches accumulated, then reshard), and the final callback is the root's end of backward
(wait for the reductions, presence, back to idle). A state's post-backward covers all of its
groups (one per dtype), so the first of its groups runs it and the others find it done; like
FSDP2's it is safe to call for a state that took no part in backward. ``stage.py`` imports
torch's ``fully_shard``, whose ``state`` finds ours through torch's composable-state slot
(``compat_fsdp2.register_torch_state``); with the switch on (``use_as_torch_fsdp``) it is ours,
which returns the same state. ``FSDPState`` gets the names from ``PipelineStageNames``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_engine._private.iteration import IterationContext
    from fsdp_engine._private.param_group import ParamGroup
    from fsdp_engine._private.state import FSDPState

__all__ = ["PipelineStageNames", "StageGroup"]


class StageGroup:
    """One of a state's groups as a pipeline stage sees it (FSDP2's ``FSDPParamGroup``'s
    ``post_backward``)."""

    def __init__(self, state: FSDPState, group: ParamGroup) -> None:
        self._state = state
        self.group = group

    def post_backward(self, *unused: Any) -> None:
        """The state's post-backward, once per backward whichever of its groups asks first."""
        from fsdp_engine._private.state import TrainingState

        if self._state.training_state is not TrainingState.POST_BACKWARD:
            self._state.post_backward()

    def __repr__(self) -> str:
        return f"StageGroup({self._state.fqn!r}, {self.group.dtype})"


class PipelineStageNames:
    """The names a pipeline stage calls on ``fully_shard.state(m)``, as views of our state
    (``FSDPState`` derives from this; module Note)."""

    @property
    def _state_ctx(self) -> IterationContext:
        return self._as_state().ctx

    @property
    def _fsdp_param_groups(self) -> list[StageGroup]:
        state = self._as_state()
        return [StageGroup(state, group) for group in state.groups]

    def _root_post_backward_final_callback(self) -> None:
        state = self._as_state()
        (state.root or state)._final_callback()

    def _as_state(self) -> FSDPState:
        from fsdp_engine._private.state import FSDPState

        assert isinstance(self, FSDPState)
        return self
