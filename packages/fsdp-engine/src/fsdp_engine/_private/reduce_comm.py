"""How a group's reduction is communicated: strategies chosen when the group is set up or
reconfigured, never a flag tested per call (as the gathers: [Note: all-gather strategies]).

[Note: reduction strategies]
What a post-backward does with a group's gradients is the reducer's state
(``GradState``: nothing pending, autograd's gradients pending, held locally without
synchronization); when it reduces, the group's ``ReduceComm`` says how:
- ``ReduceScatter``: one reduce-scatter over the shard dim into the sharded gradient storage
  (1-D FSDP), followed by one all-reduce over each replicate dim on a 2-D mesh (HSDP, and
  FSDP2's DDP mode, whose shard dim has one rank: the reduce-scatter is then a copy). Earlier
  microbatches held by ``HoldReduceScatter`` are added before the all-reduce.
- ``HoldReduceScatter``: HSDP with ``set_requires_all_reduce(False)``: the reduce-scatter only,
  accumulated into a shard-sized tensor in the reduce dtype (FSDP2's ``partial_reduce_output``);
  ``.grad`` is not touched. The next ``ReduceScatter`` adds it before its all-reduce, so the
  replica all-reduce runs once per accumulation window.
- no synchronization (``set_requires_gradient_sync(False)``): no communication; the reducer
  holds the gradients (its ``HELD`` state) until a synchronizing backward reduces them.
- the user's collectives (``set_custom_reduce_scatter``, ``set_all_reduce_hook``,
  ``set_gradient_divide_factor``...): ``ReduceSettings``, carried out by whichever strategy
  runs (the hook runs after the all-reduce, so never on a held microbatch, as in FSDP2).
``set_separate_reduce_scatter_group(True)`` gives either strategy a process group of its own
over the shard ranks (``shard_group``), so reduce-scatters and all-gathers do not share a
communicator.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Protocol

import attrs
import torch
import torch.distributed as dist

from dbuffer import DBuffer, Handle, ReduceScatterComm, ReduceSpec

__all__ = [
    "GradState",
    "HoldReduceScatter",
    "Partial",
    "ReduceComm",
    "ReduceScatter",
    "ReduceSettings",
    "Reduced",
    "choose_reduce_comm",
]


class GradState(enum.Enum):
    """Where a group's gradients are between backward and reduction ([Note: reduction
    strategies] in reduce_comm.py)."""

    IDLE = "idle"  # nothing to reduce
    PENDING = "pending"  # autograd's gradients of this window, not yet reduced or held
    HELD = "held"  # held in the accumulator (no-sync microbatches, or the compact input)
    PENDING_ON_HELD = "pending_on_held"  # a new backward's gradients, earlier ones held

    @property
    def pending(self) -> bool:
        return self in (GradState.PENDING, GradState.PENDING_ON_HELD)

    @property
    def held(self) -> bool:
        return self in (GradState.HELD, GradState.PENDING_ON_HELD)


@attrs.frozen
class Reduced:
    """What a post-backward did: which parameters autograd gave a gradient on this rank (the
    compact path sees it), which had a ``.grad`` before, and whether a reduction was issued."""

    used: list[bool]
    had_grad: list[bool]
    issued: bool


@attrs.frozen
class ReduceSettings:
    """What the user configured for a group's reductions (``FSDPModule`` setters)."""

    divide_factor: float | None = None
    force_sum: bool = False
    hook: Callable[[torch.Tensor], None] | None = None
    hook_stream: torch.Stream | None = None
    comm: ReduceScatterComm | None = None
    allocate: Callable[..., torch.Tensor] | None = None
    check_finite: bool = False  # set_check_finite_gradients ([Note: a non-finite gradient, named])


@attrs.define
class Partial:
    """Reduce-scattered microbatches not yet all-reduced (reduce dtype, the shard's size)."""

    tensor: torch.Tensor | None = None


class ReduceComm(Protocol):
    """One way to communicate a reduction ([Note: reduction strategies])."""

    @property
    def assigns_grads(self) -> bool:
        """Whether the reduction writes the sharded gradients (``.grad``)."""
        ...

    def issue(
        self,
        source: DBuffer,
        *,
        into: DBuffer | None,
        accumulate: bool,
        spec: ReduceSpec,
        reduce_dtype: torch.dtype,
        partial: Partial,
        settings: ReduceSettings,
        async_op: bool,
    ) -> Handle: ...


@attrs.frozen
class ReduceScatter:
    """Reduce-scatter into the sharded gradients, then the replicas' all-reduce (HSDP)."""

    shard_group: dist.ProcessGroup | None = None
    assigns_grads: bool = True

    def issue(
        self,
        source: DBuffer,
        *,
        into: DBuffer | None,
        accumulate: bool,
        spec: ReduceSpec,
        reduce_dtype: torch.dtype,
        partial: Partial,
        settings: ReduceSettings,
        async_op: bool,
    ) -> Handle:
        held, partial.tensor = partial.tensor, None
        return source.reduce_scatter(
            spec=spec,
            reduce_dtype=reduce_dtype,
            accumulate=accumulate,
            into=into,
            free_unsharded=True,
            async_op=async_op,
            partial=held,
            shard_group=self.shard_group,
            hook=settings.hook,
            hook_stream=settings.hook_stream,
            comm=settings.comm,
            allocate=settings.allocate,
        )


@attrs.frozen
class HoldReduceScatter:
    """HSDP microbatch without the replica all-reduce: reduce-scatter into ``partial``."""

    shard_group: dist.ProcessGroup | None = None
    assigns_grads: bool = False

    def issue(
        self,
        source: DBuffer,
        *,
        into: DBuffer | None,
        accumulate: bool,
        spec: ReduceSpec,
        reduce_dtype: torch.dtype,
        partial: Partial,
        settings: ReduceSettings,
        async_op: bool,
    ) -> Handle:
        first = partial.tensor is None
        if partial.tensor is None:
            partial.tensor = torch.empty(
                source.shard_size, dtype=reduce_dtype, device=source.device
            )
        return source.reduce_scatter(
            spec=spec,
            reduce_dtype=reduce_dtype,
            accumulate=not first,
            free_unsharded=True,
            async_op=async_op,
            hold=partial.tensor,
            shard_group=self.shard_group,
            comm=settings.comm,
            allocate=settings.allocate,
        )


def choose_reduce_comm(
    *, replicated: bool, requires_all_reduce: bool, shard_group: dist.ProcessGroup | None
) -> ReduceComm:
    """The strategy of a group's configuration ([Note: reduction strategies])."""
    if replicated and not requires_all_reduce:
        return HoldReduceScatter(shard_group)
    return ReduceScatter(shard_group)
