"""FSDP2's group lifecycle on ``ParamGroup``: ``pre_forward``, ``post_forward``, ``pre_backward``,
``post_backward`` and ``finalize_backward`` (FSDP2's ``FSDPParamGroup`` names).

[Note: the group's lifecycle]
The state (state.py) only sequences hooks: which module runs, its training state, the
prefetch targets, the iteration. Everything that reads or changes a group (whether it is
unsharded, an all-gather in flight, its reduction, the kept post-forward part, where the
gradients went) happens here, from the group's own configuration (``GroupConfig``: the
state's setters push the fields it needs) and the iteration context it was given at lazy init
(``ctx``: the inputs-ready event, the cap on reductions in flight). So each method can also be
called on its own, as torch's pipelining calls ``post_backward()`` and the root's final callback
by hand.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dbuffer import Handle
from fsdp_engine._private.gather import BufferGather
from fsdp_engine._private.replaced import check_not_replaced_unsharded
from fsdp_engine._private.trace import traced, with_fqn

if TYPE_CHECKING:
    from fsdp_engine._private.gather import Gather, PostForwardPart
    from fsdp_engine._private.iteration import IterationContext
    from fsdp_engine._private.param import FSDPParam
    from fsdp_engine._private.param_group import GroupConfig
    from fsdp_engine._private.presence import Presence
    from fsdp_engine._private.reduce import GradReducer
    from fsdp_engine._private.storage import ShardStorage

__all__ = ["GroupLifecycle", "ShardedState"]


class ShardedState(enum.Enum):
    SHARDED = "sharded"
    SHARDED_POST_FORWARD = "sharded_post_forward"
    UNSHARDED = "unsharded"


class GroupLifecycle:
    """The lifecycle methods of ``ParamGroup`` (module Note)."""

    fqn: str | None = None  # the state's module name under the root (FSDP2's trace labels)
    ctx: IterationContext | None = None  # the root's iteration, from lazy init
    # made by ParamGroup
    state: ShardedState
    unshard_handle: Handle | None
    post_forward_part: PostForwardPart | None
    reducer: GradReducer
    config: GroupConfig
    params: list[FSDPParam]
    gather: Gather
    compute_dtype: torch.dtype
    gather_dtype: torch.dtype
    storage: ShardStorage
    conversion_incomplete: list[str] | None
    presence: Presence

    def names(self) -> list[str]:
        return [p.fqn for p in self.params]

    def adopt_registered(self) -> None:
        """Take over parameters registered in place of ours while sharded (``ParamGroup``'s,
        which knows how a parameter is adopted)."""
        raise NotImplementedError

    def meta_indices(self) -> list[int]:
        return [i for i, p in enumerate(self.params) if p.is_meta]

    def trainable(self) -> tuple[bool, ...]:
        return tuple(p.sharded.requires_grad for p in self.params)

    @property
    def sharded(self) -> list[nn.Parameter]:
        return [p.sharded for p in self.params]

    def label(self, name: str) -> str:
        return with_fqn(name, self.fqn)

    def _ready(self) -> torch.Event | None:
        return None if self.ctx is None else self.ctx.inputs_ready

    def unshard_traced(self, *, async_op: bool = False) -> None:
        """Unshard in this iteration, in FSDP2's ``FSDP::all_gather`` range when an all-gather
        is issued (not when already unsharded or in flight)."""
        ready = self._ready()
        if self.state is ShardedState.UNSHARDED or self.unshard_handle is not None:
            self.unshard(async_op=async_op, ready=ready)
            return
        with traced(self.label("FSDP::all_gather"), log=False):
            self.unshard(async_op=async_op, ready=ready)

    # -- the primitives --------------------------------------------------------------------------
    def unsharded_params(self) -> list[nn.Parameter]:
        dtype = self.compute_dtype
        made = [p.unsharded(dtype) for p in self.params]
        if any(u is None for u in made):
            views = self.gather.views()
            guarded = self.config.gradients_in_place  # [Note: reading an overwritten weight]
            made = [
                p.make_unsharded(dtype, v, guarded) for p, v in zip(self.params, views, strict=True)
            ]
        return [u for u in made if u is not None]

    def register_unsharded(self) -> None:
        self.unsharded_params()  # made if needed
        check_not_replaced_unsharded(self.params)  # a replacement is never silently dropped
        for param in self.params:
            param.register_unsharded(self.compute_dtype)

    def register_sharded(self) -> None:
        for param in self.params:
            param.register_sharded()

    # -- unshard / reshard --------------------------------------------------------------------
    def _check_ready(self) -> None:
        if self.conversion_incomplete is not None:
            raise ValueError(
                f"fully_shard: the parameters of one group were converted to different dtypes "
                f"{self.conversion_incomplete} ({self.names()}); convert every module of a "
                f"fully_shard call alike"
            )
        if not self.storage.materialized:
            raise RuntimeError(
                f"fully_shard: parameters {[self.params[i].fqn for i in self.meta_indices()]} "
                "are still on the meta device; materialize them (to_empty + init, or load a "
                "state dict with assign=True) before running forward"
            )

    def unshard(self, *, async_op: bool = False, ready: torch.Event | None = None) -> None:
        """Start the all-gather (``async_op``: ``wait_for_unshard`` completes it). On an
        accelerator it waits for ``ready`` (the shards' last write this iteration) instead of
        everything the compute stream has queued, so a prefetch overlaps the compute before it."""
        if self.state is ShardedState.UNSHARDED or self.unshard_handle is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.state is ShardedState.SHARDED:
            self.adopt_registered()  # replaced since the last step ([Note: registered parameters])
        self._check_ready()
        if self.post_forward_part is not None and self.post_forward_part.held:
            handle: Handle | None = self.post_forward_part.regather(
                self.storage.buffer, self.gather_dtype, async_op=async_op
            )
        else:
            handle = self.gather.issue(ready=ready, async_op=async_op)
        self.unshard_handle = handle
        if handle is None or not async_op:
            self.wait_for_unshard(force=handle is None)

    def wait_for_unshard(self, *, force: bool = False) -> None:
        if self.unshard_handle is None and not force:
            return
        if self.unshard_handle is not None:
            self.unshard_handle.wait()  # DBuffer restores the version counter autograd checks
            self.unshard_handle = None
        self.gather.complete()
        self.state = ShardedState.UNSHARDED

    def reshard(self, *, keep_part: bool = False, release: bool = True) -> None:
        """Free the unsharded storage and register the sharded parameters (``keep_part``: a
        post-forward part just kept stays; ``release=False``: a reduction in flight reads the
        storage and frees it when done)."""
        if self.state is ShardedState.SHARDED and self.unshard_handle is None:
            return  # already sharded: the registered parameters are the sharded ones
        self.wait_for_unshard()
        if self.state is ShardedState.UNSHARDED:
            check_not_replaced_unsharded(self.params)
        if release:
            self.gather.release()
        if self.post_forward_part is not None and not keep_part:
            self.post_forward_part.drop()
        self.register_sharded()
        self.state = ShardedState.SHARDED

    def reshard_post_forward(self) -> None:
        """``reshard_after_forward=k``: keep this rank's 1/k part, free the rest."""
        assert self.post_forward_part is not None
        self.wait_for_unshard()
        self.post_forward_part.keep(self.gather.flat())
        self.reshard(keep_part=True)
        self.state = ShardedState.SHARDED_POST_FORWARD

    # -- gradients ----------------------------------------------------------------------------
    def prepare_gradients(self, *, reduces_and_reshards: bool = False) -> None:
        """Before this group's backward: the gradient storage autograd writes into.
        ``reduces_and_reshards``: this backward ends with a reduction and a reshard, so its
        gradients may overwrite the unsharded parameters when the user enabled it ([Note:
        gradients in the parameters' storage]: one plain all-gathered buffer, no cast)."""
        in_place = None
        if (
            reduces_and_reshards
            and self.config.gradients_in_place
            and self.state is ShardedState.UNSHARDED
            and type(self.gather) is BufferGather
            and self.gather_dtype == self.compute_dtype
        ):
            in_place = (self.gather.flat(), self.gather.views())
        if self.reducer.prepare(self.trainable(), self.unsharded_params(), in_place):
            self.presence.reset()

    def reduce(self, *, sync: bool, async_op: bool) -> None:
        """Post-backward: reduce the gradients (``sync``) or keep accumulating them locally."""
        unsharded = self.unsharded_params()
        self._redistribute_grads(unsharded)
        result = self.reducer.reduce(unsharded, self.config.reduce, sync=sync, async_op=async_op)
        self.presence.note_used(result.used)
        if result.issued:
            self.presence.after_reduction(result.had_grad)
            if self.reducer.handle is None:
                self._run_hooks()

    def _redistribute_grads(self, unsharded: Sequence[nn.Parameter]) -> None:
        """A DTensor parameter's gradient in its parameter's placements before the reduction
        reads its local tensor (FSDP2's ``_get_grad_inner_tensor``: e.g. a ``Partial`` on the
        tensor-parallel dims is reduced there first; an SPMD mesh's data-parallel dims keep the
        gradient's own placements)."""
        for param, spec in zip(unsharded, self.storage.tp_specs, strict=True):
            grad = param.grad
            if spec is None or not isinstance(grad, DTensor):
                continue
            target = spec.target(grad)
            if tuple(grad.placements) != target:
                param.grad = grad.redistribute(placements=target)

    def wait_for_reduce(self) -> None:
        reducer = self.reducer
        if reducer.handle is not None:
            reducer.wait()
        if reducer.hooks_due:
            self._run_hooks()

    def wait_for_reduce_input(self) -> None:
        """The in-flight cap: this group's reduce-scatter has read its input (freed now); an
        HSDP all-reduce may still run ([Note: two events per reduction] in dbuffer)."""
        self.reducer.wait_input()
        if self.reducer.handle is None:
            self._run_hooks()

    def _run_hooks(self) -> None:
        if self.presence.due is None:  # exact presence: the hooks wait for it
            self.reducer.run_post_accumulate_hooks()

    def apply_presence(self, used_anywhere: Sequence[bool]) -> None:
        self.presence.apply(used_anywhere, self.sharded)
        if self.reducer.handle is None:  # else wait_for_reduce runs them
            self._run_hooks()

    def discard_iteration(self) -> None:
        """Drop every in-flight collective and pending gradient (``reset_iter_state``)."""
        if self.unshard_handle is not None:
            self.unshard_handle.wait()
            self.unshard_handle = None
        self.reducer.discard(self.unsharded_params())
        self.presence.due = None
        self.reshard()

    # -- forward ------------------------------------------------------------------------------
    def pre_forward(self, *unused: Any, recompute: bool = False) -> None:
        """Before the module's forward: the reduction that may still read the storage done,
        all-gathered (or its prefetch waited for), the unsharded parameters registered.
        ``recompute``: an activation-checkpoint recompute inside backward."""
        if recompute:
            self.unshard(ready=self._ready())
        else:
            self.wait_for_reduce()
            self.unshard_traced()
        self.register_unsharded()

    def post_forward(self, *unused: Any) -> None:
        """After the module's forward (not in a recompute): reshard, keeping the 1/k part
        with ``reshard_after_forward=k`` when a backward follows."""
        grad = torch.is_grad_enabled()
        if self.post_forward_part is not None and grad:
            self.reshard_post_forward()
        elif self.post_forward_part is not None or self.config.reshard_after_forward or not grad:
            # no_grad (eval): no backward needs them; a copy kept would be stale after an
            # optimizer step, at the next forward (FSDP2's is)
            self.reshard()

    def drop_prefetch(self) -> None:
        """A prefetch whose module did not run: its all-gather is completed and freed."""
        if self.unshard_handle is not None and self.state is ShardedState.SHARDED:
            self.reshard()

    # -- backward -----------------------------------------------------------------------------
    def pre_backward(self, *unused: Any) -> None:
        """Before the module's backward: unsharded again (unless ``set_unshard_in_backward
        (False)``) and the gradient storage autograd writes into prepared."""
        config = self.config
        if config.unshard_in_backward:
            self.unshard_traced()
            self.register_unsharded()
        self.prepare_gradients(
            reduces_and_reshards=config.requires_gradient_sync and config.reshard_after_backward
        )

    def post_backward(self, *unused: Any) -> None:
        """After the module's backward: reshard first (FSDP2's order: the unsharded
        parameters go before the reduction's memory comes), make room under the cap on
        reductions in flight, reduce (or hold without synchronization). Gradients in the
        parameters' storage are reduced from it first and it is freed by that reduction
        ([Note: gradients in the parameters' storage])."""
        config = self.config
        sync = config.requires_gradient_sync
        in_place = self.reducer.in_place  # this backward's gradients in the parameters' storage
        if not in_place and config.reshard_after_backward and self.state is ShardedState.UNSHARDED:
            with traced(self.label("FSDP::post_backward_reshard"), log=False):
                self.reshard()
        if sync and self.ctx is not None:
            # [Note: reductions in flight], in FSDP2's range (its label, verbatim)
            self.ctx.before_reduction(self, f"FSDP::post_backward_rs_wait ({self.fqn})")
        with traced(self.label("FSDP::post_backward_reduce"), log=False):
            self.reduce(sync=sync, async_op=sync)
        if in_place:  # whatever the settings now: the storage no longer holds parameters
            self.reshard(release=self.reducer.handle is None)

    def finalize_backward(self) -> None:
        """The end of the last backward of a step: every reduction complete, its hooks run."""
        self.wait_for_reduce()
