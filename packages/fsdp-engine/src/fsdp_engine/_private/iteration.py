"""What the states of one root share through an iteration: the order modules ran in, the
reductions in flight, and the events an iteration's collectives wait on.

[Note: implicit forward prefetch]
Without ``set_modules_to_forward_prefetch``, the module that ran forward after this one in the
previous iteration (the same occurrence of this module) is all-gathered now, asynchronously,
right after this module's own all-gather and before its compute: the next group's communication
overlaps this group's compute on every backend (gloo runs it on its own threads; on accelerators
it runs on the all-gather stream, which waits only for the shards' last write, not for this
compute). FSDP2 issues that all-gather in the next module's pre-forward, after this compute was
issued; ours is issued earlier, deliberately (the issue-order test documents it). The order is
the one every rank ran (FSDP's contract: the same modules in the same order on every rank), so
the collective order stays identical on every rank. A prediction that does not come true (the
order changed) costs one unused all-gather, freed at the end of the forward. The first
iteration has no previous order: no prefetch, like FSDP2 on CPU.

[Note: reductions in flight]
A group's reduce-scatter reads its unsharded gradient storage until it completes. At most
``max_input_buffers`` reductions are in flight (``set_reduce_scatter_max_input_buffers``, FSDP2's
cap over every group of a root, 1 by default): before a group hands its gradients over, the
oldest reductions beyond the cap are waited for up to their reduce-scatter's read of the input,
which frees their storage; an HSDP all-reduce still running is not waited for (FSDP2: compute
costs max(compute, reduce-scatter), not max(compute, reduce-scatter + all-reduce); [Note: two
events per reduction] in dbuffer). More in flight lets
the next layer's backward run while an exposed reduce-scatter finishes, at the cost of that
much more gradient memory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from fsdp_engine._private import compat, gather
from fsdp_engine._private.trace import traced

if TYPE_CHECKING:
    from fsdp_engine._private.group_lifecycle import GroupLifecycle
    from fsdp_engine._private.state import FSDPState

__all__ = [
    "IterationContext",
    "backward_prefetch_targets",
    "forward_prefetch_targets",
    "iteration_event",
]


class IterationContext:
    """What the states of one root share: set up by the root's lazy init."""

    def __init__(self) -> None:
        self.all_states: list[FSDPState] = []  # the root's subtree, modules() pre-order
        self.iter_forward_root: FSDPState | None = None
        self.post_forward_order: list[FSDPState] = []  # with multiplicity, this iteration
        self.final_callback_queued = False
        self.is_last_backward = True
        self.post_optim_event: torch.Event | None = None
        # the event marking the shards' last write this iteration (accelerators): what every
        # all-gather of the iteration waits for instead of the compute stream
        self.inputs_ready: torch.Event | None = None
        self.max_in_flight = 1
        self.in_flight: deque[GroupLifecycle] = deque()
        self.pre_forward_order: list[FSDPState] = []  # this iteration, with multiplicity
        self.forward_next: dict[int, list[FSDPState | None]] = {}  # last iteration's successors
        self.forward_seen: dict[int, int] = {}  # occurrences of each state so far
        # grad-enabled forwards since the last synchronizing backward, and those backwards
        # ([Note: microbatch agreement] in runtime_checks)
        self.microbatch = 0
        self.windows = 0

    # -- the forward order --------------------------------------------------------------------
    def start_forward_order(self) -> None:
        """A new iteration: the last iteration's pre-forward order becomes the prediction."""
        if self.pre_forward_order:
            order = self.pre_forward_order
            nxt: dict[int, list[FSDPState | None]] = {}
            for i, state in enumerate(order):
                nxt.setdefault(id(state), []).append(order[i + 1] if i + 1 < len(order) else None)
            self.forward_next = nxt
        self.pre_forward_order = []
        self.forward_seen = {}

    def predicted_next(self, state: FSDPState) -> FSDPState | None:
        """The state that ran forward after this occurrence of ``state`` last iteration."""
        occurrence = self.forward_seen.get(id(state), 0)
        self.forward_seen[id(state)] = occurrence + 1
        self.pre_forward_order.append(state)
        successors = self.forward_next.get(id(state), [])
        return successors[occurrence] if occurrence < len(successors) else None

    # -- reductions ---------------------------------------------------------------------------
    def before_reduction(self, group: GroupLifecycle, label: str) -> None:
        """[Note: reductions in flight]: make room for ``group``'s reduction (waiting, in the
        profiler range ``label``, for the oldest ones beyond the cap)."""
        if self.in_flight and len(self.in_flight) >= self.max_in_flight:
            with traced(label, log=False):  # no range (no dispatcher call) unless profiling
                while self.in_flight and len(self.in_flight) >= self.max_in_flight:
                    previous = self.in_flight.popleft()
                    if previous is not group:
                        previous.wait_for_reduce_input()
        if group in self.in_flight:
            self.in_flight.remove(group)
        self.in_flight.append(group)

    def resolve_max_in_flight(self) -> None:
        caps = [g.config.max_input_buffers for s in self.all_states for g in s.groups]
        self.max_in_flight = max(caps, default=1)

    def reset(self) -> None:
        """After an iteration (or a failed one): nothing in flight, nothing pending."""
        self.final_callback_queued = False
        self.in_flight.clear()
        self.iter_forward_root = None
        self.inputs_ready = None


# -- prefetch targets ---------------------------------------------------------------------------
def forward_prefetch_targets(state: FSDPState) -> Sequence[FSDPState]:
    """Whom ``state``'s pre-forward all-gathers ahead: the explicit targets, or the predicted
    next module ([Note: implicit forward prefetch])."""
    if state.config.forward_prefetch is not None:
        return state.config.forward_prefetch
    if compat.graph_task_id() != -1:  # in a backward (compat.in_backward, without a frame)
        return ()
    target = state.ctx.predicted_next(state)
    if target is None or target is state or not target.groups:
        return ()
    return (target,)


def backward_prefetch_targets(state: FSDPState) -> Sequence[FSDPState]:
    """Whom ``state``'s pre-backward all-gathers ahead: the explicit targets, or the module
    that ran post-forward before this occurrence of ``state`` (FSDP2's reverse order)."""
    if state.config.backward_prefetch is not None:
        return [s for s in state.config.backward_prefetch if s.config.unshard_in_backward]
    if not state._post_forward_indices:
        return []
    index = state._post_forward_indices.pop()
    if index == 0:
        return []
    target = state.ctx.post_forward_order[index - 1]
    return [target] if target.config.unshard_in_backward else []


def iteration_event(states: Sequence[FSDPState]) -> torch.Event | None:
    """An event on the current stream of the states' accelerator (None on CPU): what every
    all-gather of this iteration waits for (the optimizer's writes are before it)."""
    for state in states:
        for group in state.groups:
            return gather.event_now(group.storage.device)
    return None
