"""Batched ragged exchange: every matrix's shards to its root, and the roots' results back.

[Note: one all-to-all each way per step]
Matrix ``i`` is held as flat ranges ``ranges[i][k]`` over the ranks ``k`` of one axis and has a
root ``roots[i]``. Gathering is one uneven ``all_to_all_single``: rank ``k`` sends to rank ``d``
the concatenation, in matrix order, of its pieces of every matrix rooted at ``d``; the root then
finds each piece at a known offset and, since the ranges are increasing in ``k`` and tile the
matrix, concatenating the pieces over ``k`` is the matrix's row-major storage. Scattering back is
the mirror image. Each matrix crosses the network at most once each way, excluding the root's own
piece: traffic <= 2x the exchanged bytes, against ``world``x for gather-to-all. Payloads travel as
raw bytes (``uint8`` views), so any dtype works on any backend (gloo has no bf16 all-to-all).

Plan (pure, cached per layout) then execute, like DTensor's redistribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist

__all__ = ["ExchangePlan", "plan_exchange", "gather_to_roots", "scatter_from_roots"]


@attrs.frozen
class ExchangePlan:
    """Who sends what to whom, for this rank (``coord``) of the axis."""

    coord: int
    world: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    roots: tuple[int, ...]
    send_counts: tuple[int, ...]
    """Elements this rank sends to each rank when gathering (= receives when scattering)."""
    recv_counts: tuple[int, ...]
    """Elements this rank receives from each rank when gathering (= sends when scattering)."""
    mine: tuple[int, ...]
    """Indices of the matrices rooted here, in matrix order."""

    def local_numel(self, i: int) -> int:
        lo, hi = self.ranges[i][self.coord]
        return hi - lo

    @property
    def moved_elements(self) -> int:
        """Elements this rank sends over the network per direction (own pieces excluded)."""
        return sum(n for d, n in enumerate(self.send_counts) if d != self.coord)


def plan_exchange(
    coord: int, ranges: Sequence[Sequence[tuple[int, int]]], roots: Sequence[int]
) -> ExchangePlan:
    world = len(ranges[0]) if ranges else 1
    send = [0] * world
    recv = [0] * world
    for i, root in enumerate(roots):
        lo, hi = ranges[i][coord]
        send[root] += hi - lo
        if root == coord:
            for k, (a, b) in enumerate(ranges[i]):
                recv[k] += b - a
    mine = tuple(i for i, r in enumerate(roots) if r == coord)
    return ExchangePlan(
        coord,
        world,
        tuple(tuple((int(a), int(b)) for a, b in r) for r in ranges),
        tuple(roots),
        tuple(send),
        tuple(recv),
        mine,
    )


def _a2a_bytes(
    output: torch.Tensor,
    inp: torch.Tensor,
    out_counts: Sequence[int],
    in_counts: Sequence[int],
    group: dist.ProcessGroup,
) -> dist.Work | None:
    size = inp.element_size()
    work: dist.Work | None = dist.all_to_all_single(
        output.view(torch.uint8),
        inp.view(torch.uint8),
        [n * size for n in out_counts],
        [n * size for n in in_counts],
        group=group,
        async_op=True,
    )
    return work


def gather_to_roots(
    plan: ExchangePlan, locals_: Sequence[torch.Tensor], group: dist.ProcessGroup
) -> tuple[dist.Work | None, torch.Tensor]:
    """Start the gather; returns ``(work, received)``. ``locals_[i]`` is this rank's flat piece
    of matrix ``i`` (all of one dtype/device). Call ``assemble`` after ``work.wait()``."""
    ref = locals_[0]
    order = sorted(range(len(plan.roots)), key=lambda i: (plan.roots[i], i))
    pieces = [locals_[i] for i in order if locals_[i].numel()]
    send = torch.cat(pieces) if pieces else ref.new_empty(0)
    recv = ref.new_empty(sum(plan.recv_counts))
    work = _a2a_bytes(recv, send, plan.recv_counts, plan.send_counts, group)
    return work, recv


def assemble(plan: ExchangePlan, received: torch.Tensor) -> dict[int, torch.Tensor]:
    """Flat full matrices rooted here, from the gather's receive buffer."""
    src_offset = [sum(plan.recv_counts[:k]) for k in range(plan.world)]
    chunks: dict[int, list[torch.Tensor]] = {i: [] for i in plan.mine}
    for k in range(plan.world):
        pos = src_offset[k]
        for i in plan.mine:
            lo, hi = plan.ranges[i][k]
            chunks[i].append(received[pos : pos + hi - lo])
            pos += hi - lo
    return {i: torch.cat(parts) for i, parts in chunks.items()}


def scatter_from_roots(
    plan: ExchangePlan,
    results: dict[int, torch.Tensor],
    like: torch.Tensor,
    group: dist.ProcessGroup,
) -> tuple[dist.Work | None, torch.Tensor]:
    """Start sending each root result's pieces back; ``results[i]`` is matrix ``i`` flat."""
    pieces = []
    for k in range(plan.world):
        for i in plan.mine:
            lo, hi = plan.ranges[i][k]
            if hi > lo:
                pieces.append(results[i][lo:hi])
    send = torch.cat(pieces) if pieces else like.new_empty(0)
    recv = like.new_empty(sum(plan.send_counts))
    work = _a2a_bytes(recv, send, plan.send_counts, plan.recv_counts, group)
    return work, recv


def split_scattered(plan: ExchangePlan, received: torch.Tensor) -> dict[int, torch.Tensor]:
    """This rank's flat piece of every matrix, from the scatter's receive buffer."""
    out: dict[int, torch.Tensor] = {}
    pos = 0
    for i in sorted(range(len(plan.roots)), key=lambda j: (plan.roots[j], j)):
        n = plan.local_numel(i)
        out[i] = received[pos : pos + n]
        pos += n
    return out
