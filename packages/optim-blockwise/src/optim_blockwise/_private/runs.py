"""Runs: consecutive parameters that are views of one storage, stepped as one flat tensor.

[Note: runs]
A sharding engine with flat buffers (fsdp-engine) makes every parameter's local shard a view of
one storage per group, and every gradient a view of one gradient storage at the same relative
offsets. An elementwise (or blockwise) update of such parameters can run on the concatenation
directly: one flat view of the parameters, one of the gradients, one of each state buffer, a
constant number of kernels for the whole run instead of per parameter. Nothing is assumed about
the engine: adjacency is read from the tensors (storage, offset, contiguity; a local tensor over
storage of its own is placed in the storage it was cut from, ragged_dtensor's ``storage_base``),
and anything else (plain parameters, gradients set by hand) falls back to runs of one.

The optimizer's state then lives in one flat buffer per storage (``compact``: parameters sorted
by offset, gaps dropped), so a run's state is one slice too; ``state[p]`` holds views.

``group_runs`` is the one grouping rule every run-stepping optimizer uses (``AdamW8bit``,
``FlatAdamW`` / ``FlatAdam``); each adds what else must match (``keys``: param group, step count,
state kind) and what else a join needs (``may_join``: e.g. quantization blocks kept whole).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Literal

import attrs
import torch
from torch.distributed.tensor import DTensor

from ragged_dtensor import storage_base

__all__ = [
    "Run",
    "Slot",
    "slot_of",
    "local_of",
    "follows",
    "grads_follow",
    "flat_view",
    "compact",
    "group_runs",
]

StorageKey = tuple[int, torch.dtype, torch.device]


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@attrs.frozen
class Slot:
    """Where one parameter's local data lies: its storage, element offset, numel."""

    storage: StorageKey
    offset: int
    numel: int
    contiguous: bool


def _based(local: torch.Tensor) -> tuple[torch.UntypedStorage, int]:
    """The storage ``local``'s memory belongs to, and ``local``'s element offset in it: a local
    tensor over storage of its own cut from a flat buffer (ragged_dtensor's
    ``own_storage_view``) is placed in that buffer."""
    base, byte_offset = storage_base(local)
    return base, byte_offset // local.element_size() + int(local.storage_offset())


def slot_of(param: torch.Tensor) -> Slot:
    local = local_of(param)
    base, offset = _based(local)
    key = (base.data_ptr(), local.dtype, local.device)
    return Slot(key, offset, local.numel(), local.is_contiguous())


def follows(prev: Slot, nxt: Slot) -> bool:
    """``nxt``'s data starts where ``prev``'s ends, in the same storage."""
    return (
        prev.storage == nxt.storage
        and prev.contiguous
        and nxt.contiguous
        and nxt.offset == prev.offset + prev.numel
    )


def grads_follow(prev: torch.Tensor, nxt: torch.Tensor, prev_numel: int) -> bool:
    """Local gradient ``nxt`` starts where ``prev`` (``prev_numel`` elements) ends, in one
    storage (so one flat view spans both)."""
    return (
        nxt.is_contiguous()
        and prev.is_contiguous()
        and nxt.dtype == prev.dtype
        and nxt.data_ptr() == prev.data_ptr() + prev_numel * nxt.element_size()
        and storage_base(nxt)[0].data_ptr() == storage_base(prev)[0].data_ptr()
    )


def flat_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of ``first``'s storage from ``first``'s start: a view of its base, so
    in-place updates bump the version counter autograd checks. Where ``first`` is over storage
    of its own cut from a flat buffer (``own_storage_view``), the run spans that buffer: a
    tensor over it (the same memory; its own version counter)."""
    base, offset = _based(first)
    if base.data_ptr() == first.untyped_storage().data_ptr() and base.nbytes() == (
        first.untyped_storage().nbytes()
    ):
        return first.as_strided((numel,), (1,), first.storage_offset())
    return first.new_empty(0).set_(base, offset, (numel,), (1,))


def compact(slots: Sequence[Slot], sizes: Iterable[int] | None = None) -> list[int]:
    """Offsets of each slot in a compact buffer of its storage (slots sorted by offset, gaps
    dropped). ``sizes[i]`` (default: numel) is what slot ``i`` takes in the buffer (e.g. its
    number of quantization blocks)."""
    length = list(sizes) if sizes is not None else [s.numel for s in slots]
    offsets = [0] * len(slots)
    totals: dict[StorageKey, int] = {}
    for i in sorted(range(len(slots)), key=lambda j: (slots[j].storage[0], slots[j].offset, j)):
        key = slots[i].storage
        offsets[i] = totals.get(key, 0)
        totals[key] = offsets[i] + length[i]
    return offsets


@attrs.frozen
class Run:
    """Members stepped as one flat update."""

    members: tuple[int, ...]
    """Indices of the members, in storage order."""
    numel: int
    anchor: int
    """The member whose data starts the run: its first with elements (the first if none has)."""


def group_runs(
    slots: Sequence[Slot],
    grads: Sequence[torch.Tensor],
    keys: Sequence[Hashable],
    *,
    empty: Literal["skip", "join"] = "skip",
    may_join: Callable[[int, int], bool] | None = None,
) -> list[Run]:
    """The runs of members ``0 .. n-1``: ``slots[i]`` is where member ``i``'s local data lies,
    ``grads[i]`` its local gradient, ``keys[i]`` what must be equal for two members to share one
    update (param group, step count, state kind).

    Members are taken in storage order. One joins the current run when its key equals the run's
    last member's, its data follows the run's last member with elements in one storage and so
    does its gradient (one flat view then spans both), and ``may_join(last, i)`` allows it.

    Members without elements have nothing to compute: ``"skip"`` leaves them out of every run;
    ``"join"`` adds one to the current run when the keys match (it shares the run's step), else
    it starts a run, which the next member with its key joins wherever that member's data lies
    (the run has no data yet that it would have to follow).
    """
    order = sorted(range(len(slots)), key=lambda i: (slots[i].storage[0], slots[i].offset))
    runs: list[Run] = []
    current: list[int] = []
    numel = 0
    last = -1  # the current run's last member with elements

    def close() -> None:
        anchor = next((j for j in current if slots[j].numel), current[0])
        runs.append(Run(tuple(current), numel, anchor))

    for i in order:
        n = slots[i].numel
        if n == 0 and empty == "skip":
            continue
        joins = bool(current) and keys[i] == keys[current[-1]]
        if joins and n and numel:
            joins = (
                follows(slots[last], slots[i])
                and grads_follow(grads[last], grads[i], slots[last].numel)
                and (may_join is None or may_join(last, i))
            )
        if current and not joins:
            close()
            current, numel = [], 0
        current.append(i)
        numel += n
        if n:
            last = i
    if current:
        close()
    return runs
