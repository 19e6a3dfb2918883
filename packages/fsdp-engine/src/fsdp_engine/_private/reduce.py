"""A group's gradients: handed from autograd to one reduce-scatter, or accumulated without one.

[Note: gradients without copies]
Gradients mirror the parameters: autograd accumulates into views of an unsharded gradient
storage (zeroed once per backward, one kernel) attached as the unsharded parameters' ``.grad``,
and one reduce-scatter writes the sharded gradient storage whose views are the sharded
parameters' ``.grad``. Nothing is copied in or out.

[Note: conditional compute]
A parameter that gets no gradient on some rank (a branch skipped there, an expert that received
no tokens) is a zero contribution: the unsharded gradient storage is zeroed before backward and
the reduction always covers every trainable parameter of the group. So every rank issues the
same collective with the same sizes whatever its data did, and after the reduction every
trainable parameter has a ``.grad`` on every rank (the presence rule: ``presence.py``).

[Note: frozen parameters]
``requires_grad`` is read from the sharded parameters at every backward (FSDP2's rule), so
freezing or unfreezing after ``fully_shard`` takes effect at the next one. The reduction follows
the trainable mask, chosen when the mask changes: ``"full"`` (every parameter trainable: the
zero-copy path above), ``"none"``, or ``"compact"``: autograd makes the trainable parameters'
unsharded gradients, post-backward adds them into a compact reduce-scatter input (each rank's
segment holds the trainable pieces of that rank's shard, ``compact_pieces``) and the
reduce-scatter writes a compact sharded gradient storage whose slices are exactly the trainable
parameters' local shares. Frozen parameters are neither communicated nor given a ``.grad``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, Handle, ReduceSpec
from fsdp_engine._private import compat
from fsdp_engine._private.compact import (
    Reduction,
    add_compact,
    compact_buffer,
    reduction_for_mask,
)
from fsdp_engine._private.grads import ShardedGrads
from fsdp_engine._private.handover import InPlaceHandover, handover_casts, handover_for
from fsdp_engine._private.param import FSDPParam
from fsdp_engine._private.reduce_comm import (
    GradState,
    Partial,
    ReduceComm,
    Reduced,
    ReduceScatter,
    ReduceSettings,
)
from fsdp_engine._private.storage import ShardStorage

__all__ = ["GradReducer", "GradState", "ReduceSettings", "Reduced"]


class GradReducer:
    """A group's gradient path (module Notes): its ``GradState``, and how it communicates
    (``comm``, chosen by the group when it is set up or reconfigured)."""

    def __init__(
        self,
        storage: ShardStorage,
        params: Sequence[FSDPParam],
        *,
        compute_dtype: torch.dtype,
        reduce_dtype: torch.dtype,
        align: int,
    ) -> None:
        self.storage = storage
        self.params = params
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.align = align
        # only its unsharded part is used: no shard memory ([Note: gradient hand-over])
        # A hand-over that copies autograd's gradients writes them in the reduce dtype at once
        # (a cast fused with the copy, FSDP2's copy-in), so the reduction casts nothing and
        # no-sync microbatches accumulate in the reduce dtype in place; autograd accumulating
        # into the storage needs the compute dtype.
        flat_dtype = reduce_dtype if handover_casts() or storage.copies else compute_dtype
        self.unsharded_grads = storage.buffer.new_like(flat_dtype, zero=False)
        self.unsharded_grads.shard.untyped_storage().resize_(0)
        self.handover = handover_for(storage, self.unsharded_grads, flat_dtype)
        self.grads = ShardedGrads(storage, params)  # [Note: gradient storage lifetimes]
        self.reduction: Reduction | None = None
        self.accum: DBuffer | None = None
        self.state = GradState.IDLE
        self.comm: ReduceComm = ReduceScatter()
        self.partial = Partial()  # HSDP microbatches reduce-scattered without the all-reduce
        self._specs: dict[tuple[float | None, bool], ReduceSpec] = {}
        self.handle: Handle | None = None
        self.hooks_due = False
        self.issued = False
        # this backward's norm of the reduce-scatter input, on the device (opt-in check)
        self.local_norm: torch.Tensor | None = None

    @property
    def in_place(self) -> bool:
        """This backward's gradients go into the unsharded parameters' storage."""
        return isinstance(self.handover, InPlaceHandover) and self.handover.armed

    @property
    def busy(self) -> bool:
        return self.state is not GradState.IDLE

    # -- the reduction of a mask --------------------------------------------------------------
    def reduction_for(self, mask: tuple[bool, ...]) -> Reduction:
        """The reduction of ``mask``, chosen again only when the mask changes."""
        current = self.reduction
        if current is not None and current.mask == mask:
            return current
        reduction = reduction_for_mask(self.storage, mask, self.align)
        if current is not None and (self.busy or self.partial.tensor is not None):
            raise RuntimeError(
                "fully_shard: requires_grad of parameters changed while gradients were being "
                "accumulated without synchronization; change it between optimizer steps"
            )
        live = [p.sharded.grad for p in self.params]
        self.reduction = reduction
        self.accum = None
        if current is not None:
            self.grads.forget()
            if any(g is not None for g in live):
                self.grads.adopt(reduction, live)
        return reduction

    def adopt_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Gradients ``_apply`` converted: into our storage, as the ``.grad``."""
        mask = tuple(p.sharded.requires_grad for p in self.params)
        self.grads.adopt(self.reduction_for(mask), grads)

    # -- before backward ----------------------------------------------------------------------
    def prepare(
        self,
        mask: tuple[bool, ...],
        unsharded: Sequence[torch.nn.Parameter],
        in_place: tuple[torch.Tensor, Sequence[torch.Tensor]] | None = None,
    ) -> bool:
        """Before this group's backward: the hand-over's preparation ([Note: gradient
        hand-over]); compact path: autograd makes the gradients, post-backward collects them.
        ``in_place``: the unsharded parameters' flat storage and views, where this backward's
        gradients may go ([Note: gradients in the parameters' storage]). Returns whether a new
        backward's gradients start now."""
        reduction = self.reduction_for(mask)
        if reduction.kind == "none" or self.state.pending:
            return False
        # a module used twice in one backward: its first reduction may still read the storage
        # about to be zeroed for the second
        self.wait()
        if self.storage.bitcast:
            names = [p.fqn for p, rg in zip(self.params, reduction.mask, strict=True) if rg]
            raise NotImplementedError(
                f"fully_shard: trainable {self.storage.dtype} parameters {names}: gradients of "
                "this dtype cannot be reduced; keep them frozen (requires_grad=False)"
            )
        handover = self.handover
        if reduction.kind == "full" and not self.storage.copies:
            if (
                in_place is not None
                and isinstance(handover, InPlaceHandover)
                and not self.state.held
                and in_place[0].dtype == self.reduce_dtype == self.storage.buffer.dtype
            ):
                handover.arm(in_place[0], in_place[1], unsharded)
            else:
                handover.prepare(unsharded)
        # else: autograd makes the gradients; post-backward collects them (compact, and
        # [Note: placed groups] copied into FSDP2's order)
        started = not self.state.held
        self.state = GradState.PENDING_ON_HELD if self.state.held else GradState.PENDING
        return started

    # -- after backward -----------------------------------------------------------------------
    def reduce(
        self,
        unsharded: Sequence[torch.nn.Parameter],
        settings: ReduceSettings,
        *,
        sync: bool,
        async_op: bool,
    ) -> Reduced:
        """Post-backward: reduce the gradients (``sync``) or keep accumulating them locally."""
        reduction = self.reduction
        had = [p.sharded.grad is not None for p in self.params]
        used = [False] * len(self.params)
        issued = self.issued = False
        if reduction is not None and reduction.kind == "full":
            used = self._reduce_full(reduction, unsharded, settings, sync=sync, async_op=async_op)
            used = used or [False] * len(self.params)
        elif reduction is not None and reduction.kind == "compact":
            used = self._reduce_compact(
                reduction, unsharded, settings, sync=sync, async_op=async_op
            )
        issued = self.issued
        return Reduced(used, had, issued)

    def _detach(self, unsharded: Sequence[torch.nn.Parameter]) -> None:
        self.handover.detach(unsharded)  # autograd's references go before the storage is freed

    def _accumulator(self, like: DBuffer) -> DBuffer:
        if self.accum is None:
            self.accum = like.new_like(self.reduce_dtype)
            self.accum.shard.untyped_storage().resize_(0)
        if not self.state.held:
            self.accum.alloc_unsharded(zero=True)
        return self.accum

    def _copy_in(self, unsharded: Sequence[torch.nn.Parameter]) -> list[bool]:
        """[Note: placed groups]: autograd's gradients into FSDP2's rank-major order, the
        reduce-scatter's input in the reduce dtype (zeros where a parameter got none, and in the
        padding); a later microbatch of the window adds (FSDP2 accumulates in the reduce dtype);
        the gradients are dropped. Returns which parameters had one."""
        placed = self.storage.placed
        if not self.storage.copies or placed is None:
            return []
        first = not self.unsharded_grads.is_unsharded()
        if first:
            self.unsharded_grads.alloc_unsharded(zero=True)
        flat = self.unsharded_grads.unsharded_flat()
        used = [p.grad is not None for p in unsharded]
        with torch.no_grad():
            for i, param in enumerate(unsharded):
                if param.grad is not None:
                    placed.copy_in(param.grad, i, flat, accumulate=not first)
                    param.grad = None
        return used

    def _reduce_full(
        self,
        reduction: Reduction,
        unsharded: Sequence[torch.nn.Parameter],
        settings: ReduceSettings,
        *,
        sync: bool,
        async_op: bool,
    ) -> list[bool]:
        if not self.busy:
            return []
        used: list[bool] = []
        in_place = self.in_place
        if self.state.pending and self.storage.copies:
            used = self._copy_in(unsharded)  # every microbatch
        elif self.state.pending:
            used = self.handover.collect(unsharded)
        if in_place:
            return self._reduce_parameters(reduction, unsharded, used, settings, sync, async_op)
        # no-sync accumulation runs in reduce_dtype (FSDP2): a compute-dtype microbatch gradient
        # is added into a reduce_dtype accumulator and the compute buffer is let go
        separate = self.reduce_dtype != self.unsharded_grads.dtype
        if self.state.pending and (self.state.held or (separate and not sync)):
            accum = self._accumulator(self.unsharded_grads)
            accum.unsharded_flat().add_(self.unsharded_grads.unsharded_flat())
            self._detach(unsharded)
            self.unsharded_grads.reshard()
            self.state = GradState.HELD
        if not sync:
            return used  # same dtype: the next microbatch adds into the unsharded storage
        source = self.accum if self.state.held else self.unsharded_grads
        assert source is not None
        self._detach(unsharded)
        self._issue(reduction, source, settings, async_op=async_op)
        self.state = GradState.IDLE
        return used

    def _reduce_parameters(
        self,
        reduction: Reduction,
        unsharded: Sequence[torch.nn.Parameter],
        used: list[bool],
        settings: ReduceSettings,
        sync: bool,
        async_op: bool,
    ) -> list[bool]:
        """[Note: gradients in the parameters' storage]: the unsharded parameter storage holds
        the gradients; the reduce-scatter reads it and frees it when done (the group skips
        its own free meanwhile). Synchronization turned off during the backward: they go
        into the accumulator instead."""
        self._detach(unsharded)
        params = self.storage.buffer
        if sync:
            self._issue(reduction, params, settings, async_op=async_op)
            self.state = GradState.IDLE
        else:
            accum = self._accumulator(params)
            accum.unsharded_flat().add_(params.unsharded_flat())
            self.state = GradState.HELD
        return used

    def _reduce_compact(
        self,
        reduction: Reduction,
        unsharded: Sequence[torch.nn.Parameter],
        settings: ReduceSettings,
        *,
        sync: bool,
        async_op: bool,
    ) -> list[bool]:
        used = [False] * len(self.params)
        if self.state.pending:
            if self.accum is None:
                self.accum = compact_buffer(self.storage, reduction.segment, self.reduce_dtype)
                self.accum.shard.untyped_storage().resize_(0)
            if not self.state.held:
                self.accum.alloc_unsharded(zero=True)
            grads = [_local(u.grad) for u in unsharded]
            with torch.no_grad():
                used = add_compact(self.accum.unsharded_flat(), reduction, grads)
            self._detach(unsharded)
            self.state = GradState.HELD
        if sync and self.state.held:
            assert self.accum is not None
            self._issue(reduction, self.accum, settings, async_op=async_op)
            self.state = GradState.IDLE
        return used

    def _issue(
        self, reduction: Reduction, source: DBuffer, settings: ReduceSettings, *, async_op: bool
    ) -> None:
        """The group's ``comm`` reduces ``source`` ([Note: reduction strategies]): into the
        sharded gradient storage, each trainable parameter's ``.grad`` becoming its view
        (accumulating into a ``.grad`` already there, which must be ours), or held for a later
        all-reduce."""
        comm = self.comm
        if settings.check_finite:  # before the reduction frees it; no host read
            self.local_norm = torch.linalg.vector_norm(source.unsharded_flat(), dtype=torch.float32)
        key = (settings.divide_factor, settings.force_sum)  # every source is on the same mesh
        spec = self._specs.get(key)
        if spec is None:  # the same arithmetic every step: worked out once
            spec = self._specs[key] = source.reduce_spec(
                "avg",
                self.reduce_dtype,
                divide_factor=settings.divide_factor,
                force_sum=settings.force_sum,
            )
        grads: DBuffer | None = None
        views: list[DTensor | None] = []
        accumulate = False
        if comm.assigns_grads:
            grads, views, accumulate = self.grads.target(reduction)
        handle = comm.issue(
            source,
            into=grads,
            accumulate=accumulate,
            spec=spec,
            reduce_dtype=self.reduce_dtype,
            partial=self.partial,
            settings=settings,
            async_op=async_op,
        )
        self.handle = None if handle.done else handle
        for param, view in zip(self.params, views, strict=False):
            if view is not None:
                param.sharded.grad = view
        self.hooks_due = self.issued = comm.assigns_grads

    # -- completion and lifetimes -------------------------------------------------------------
    def wait_input(self) -> None:
        """Until the reduce-scatter has read its input, which is then freed (the in-flight cap:
        [Note: two events per reduction] in dbuffer); the rest stays in flight."""
        if self.handle is not None:
            self.handle.wait_input()
            if self.handle.done:
                self.handle = None

    def wait(self) -> None:
        if self.handle is not None:
            self.handle.wait()
            self.handle = None

    def run_post_accumulate_hooks(self) -> None:
        """Hooks registered on the sharded parameters (``register_post_accumulate_grad_hook``,
        e.g. an optimizer step in backward) run once their reduced gradient is ready."""
        if not self.hooks_due:
            return
        self.hooks_due = False
        for param in self.params:
            sharded = param.sharded
            if sharded.grad is None:
                continue
            for hook in compat.post_accumulate_grad_hooks(sharded):
                hook(sharded)

    def discard(self, unsharded: Sequence[torch.nn.Parameter]) -> None:
        """Drop every pending gradient (``reset_iter_state``)."""
        self.wait()
        self._detach(unsharded)
        if isinstance(self.handover, InPlaceHandover):
            self.handover.disarm()  # the group's reshard frees the parameters' storage
        self.unsharded_grads.reshard()
        if self.accum is not None:
            self.accum.reshard()
        self.state = GradState.IDLE
        self.partial = Partial()
        self.hooks_due = False
        self.local_norm = None


def _local(grad: torch.Tensor | None) -> torch.Tensor | None:
    return compat.local_tensor(grad) if isinstance(grad, DTensor) else grad
