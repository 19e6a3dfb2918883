"""Owner exchange: every unit's pieces to its owner and the owner's results back, in buckets
pipelined against the owner's compute.

[Note: units, owners, buckets]
A *unit* is a flat tensor that some rank must see whole (a matrix for Muon, one expert's matrix
of a 3-D weight, a preconditioner block). Unit ``i`` is held as flat ranges ``ranges[i][k]`` over
the ranks ``k`` of one mesh axis (increasing in ``k``, tiling ``[0, numel)``; empty ranges
allowed) and has an owner ``owners[i]`` (see ``owners.assign_owners``). The units are split into
buckets; each owner's units are cut into consecutive chunks of about equal weight, and bucket
``b`` holds chunk ``b`` of every owner, so every bucket keeps every owner about equally busy.

Per bucket, two uneven ``all_to_all_single`` calls:

- gather: rank ``k`` sends owner ``d`` the concatenation, in unit order, of its pieces of every
  unit of the bucket that ``d`` owns. Because the ranges are increasing in ``k`` and tile the
  unit, concatenating the pieces an owner receives over ``k`` is the unit's flat data;
- scatter (the mirror image): every owner sends each rank that rank's piece of each result.

Each unit crosses the network at most once each way (the owner's own piece stays local in the
collective): traffic <= 2x the exchanged bytes, against ``world``x for gather-to-all. Payloads
travel as raw bytes (``uint8`` views), so any dtype works on any backend (gloo has no bf16
all-to-all).

[Note: the pipeline]
``OwnerExchange.run`` keeps ``in_flight`` gathers ahead of the compute (two, like torchtitan's
DistMuon):

    start gather 0, 1;  overlap()            # e.g. the elementwise work of other parameters
    for b: wait gather b; compute b; start scatter b; start gather b + 2;
           wait scatter b - 1; apply b - 1
    wait the last scatter; apply it

so the communication of one bucket runs under the compute of its neighbours and only the first
gather and the last scatter are exposed. ``piece(i)`` is called when unit ``i``'s bucket is about
to be sent, so work that produces pieces (Muon's momentum) is interleaved too. The order of
collectives depends only on the plan, which every rank computes from the same global
description: identical on every rank by construction.

[Note: presence flags, no host synchronization] is in ``presence``.

Plan (pure) then execute, like DTensor's redistribution: ``plan_owner_exchange`` makes an
``OwnerExchange`` once per layout (the plan, the ranks' agreement on it, every bucket's byte
layout), and its ``run`` executes it in every step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from optim_blockwise._private.agree import check_agreement, fingerprint
from optim_blockwise._private.exchange_plan import (
    Bucket,
    ExchangePlan,
    ExchangeStats,
    bucket_count,
    plan_exchange,
)
from optim_blockwise._private.presence import (
    MixedPresenceError,
    PresenceFlags,
    check_presence,
    presence_status,
)

__all__ = [
    "Bucket",
    "BucketLayout",
    "ExchangePlan",
    "ExchangeStats",
    "MixedPresenceError",
    "OwnerExchange",
    "PresenceFlags",
    "bucket_count",
    "check_presence",
    "plan_exchange",
    "plan_owner_exchange",
    "presence_status",
]

_ALIGN = 16  # bytes: flag segments are padded so the next data segment stays aligned


def _pad(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class BucketLayout:
    """Byte layout of one bucket's two all-to-alls on this rank, for one element size; the pure
    packing and unpacking of the buffers (the collectives are ``OwnerExchange.run``'s).

    Gather, to each rank ``d``: ``[data of d's units][one flag per unit d owns, padded]``.
    Scatter, from each owner ``d``: ``[this rank's pieces of d's results][statuses, padded]``.
    """

    def __init__(self, plan: ExchangePlan, bucket: Bucket, size: int, flags: bool) -> None:
        self.plan, self.bucket, self.size, self.flags = plan, bucket, size, flags
        self._presence = PresenceFlags()
        w, me = plan.world, plan.coord
        self.flag_bytes = [(_pad(len(bucket.owned[d])) if flags else 0) for d in range(w)]
        own = self.flag_bytes[me]
        self.gather_send = [bucket.send_counts[d] * size + self.flag_bytes[d] for d in range(w)]
        self.gather_recv = [bucket.recv_counts[k] * size + own for k in range(w)]
        self.scatter_send = self.gather_recv  # the mirror image
        self.scatter_recv = self.gather_send

    @property
    def mine(self) -> tuple[int, ...]:
        return self.bucket.owned[self.plan.coord]

    def pack_gather(
        self, pieces: dict[int, torch.Tensor], present: Sequence[bool] | None, device: torch.device
    ) -> torch.Tensor:
        """This rank's gather send buffer from its flat piece of every unit of the bucket."""
        parts: list[torch.Tensor] = []
        for d in range(self.plan.world):
            for i in self.bucket.owned[d]:
                if self.plan.local_numel(i):
                    parts.append(pieces[i].view(torch.uint8))
            if self.flags:
                assert present is not None
                values = [present[i] for i in self.bucket.owned[d]]
                parts.append(self._presence(values, self.flag_bytes[d], torch.uint8, device))
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)

    def unpack_gather(
        self, recv: torch.Tensor, dtype: torch.dtype
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """On the owner: each owned unit's whole flat data, and the status of each (0: present
        on no rank, 1: on every rank, 2: mixed; ``None`` without flags)."""
        plan, size, mine = self.plan, self.size, self.mine
        parts: dict[int, list[torch.Tensor]] = {i: [] for i in mine}
        rows = []
        pos = 0
        for k in range(plan.world):
            for i in mine:
                lo, hi = plan.ranges[i][k]
                parts[i].append(recv[pos : pos + (hi - lo) * size])
                pos += (hi - lo) * size
            if self.flags:
                rows.append(recv[pos : pos + len(mine)])
                pos += self.flag_bytes[plan.coord]
        fulls = {i: torch.cat(p).view(dtype) for i, p in parts.items()}
        status = None
        if self.flags and mine:
            status = presence_status(torch.stack(rows).to(torch.int32).sum(0), plan.world)
        return fulls, status

    def pack_scatter(
        self, results: dict[int, torch.Tensor], status: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        """The owner's scatter send buffer: every rank's piece of each result, and statuses."""
        plan, mine = self.plan, self.mine
        out: list[torch.Tensor] = []
        for k in range(plan.world):
            for i in mine:
                lo, hi = plan.ranges[i][k]
                if hi > lo:
                    out.append(results[i][lo:hi].view(torch.uint8))
            if self.flags:
                seg = torch.zeros(self.flag_bytes[plan.coord], dtype=torch.uint8, device=device)
                if status is not None:
                    seg[: len(mine)] = status
                out.append(seg)
        return torch.cat(out) if out else torch.empty(0, dtype=torch.uint8, device=device)

    def unpack_scatter(
        self, back: torch.Tensor, dtype: torch.dtype
    ) -> tuple[dict[int, torch.Tensor], torch.Tensor | None]:
        """This rank's piece of every unit's result (views of ``back``), and every unit's
        status in ``bucket.units`` order (``None`` without flags)."""
        plan, size = self.plan, self.size
        pieces: dict[int, torch.Tensor] = {}
        statuses = []
        pos = 0
        for d in range(plan.world):
            for i in self.bucket.owned[d]:
                n = plan.local_numel(i) * size
                pieces[i] = back[pos : pos + n].view(dtype)
                pos += n
            if self.flags:
                statuses.append(back[pos : pos + len(self.bucket.owned[d])])
                pos += self.flag_bytes[d]
        return pieces, (torch.cat(statuses) if self.flags else None)


def _a2a(
    out: torch.Tensor,
    inp: torch.Tensor,
    out_splits: list[int],
    in_splits: list[int],
    group: dist.ProcessGroup,
) -> dist.Work | None:
    work: dist.Work | None = dist.all_to_all_single(
        out, inp, out_splits, in_splits, group=group, async_op=True
    )
    return work


class OwnerExchange:
    """An owner exchange made for one layout (by ``plan_owner_exchange``): the plan over
    ``group``, the byte layout of every bucket, and, with ``flags``, the presence flags of the
    module note; ``run`` executes it in every step."""

    def __init__(
        self,
        plan: ExchangePlan,
        group: dist.ProcessGroup,
        *,
        dtype: torch.dtype,
        device: torch.device,
        flags: bool,
        what: str,
        names: Callable[[int], str],
    ) -> None:
        self.plan, self.group, self.dtype, self.device = plan, group, dtype, device
        self.flags, self.what, self.names = flags, what, names
        self.layouts = [BucketLayout(plan, b, dtype.itemsize, flags) for b in plan.buckets]

    def run(
        self,
        *,
        piece: Callable[[int], torch.Tensor],
        compute: Callable[[Bucket, dict[int, torch.Tensor]], dict[int, torch.Tensor]],
        apply: Callable[[Bucket, dict[int, torch.Tensor]], None],
        present: Sequence[bool],
        overlap: Callable[[], None] | None = None,
        in_flight: int = 2,
    ) -> ExchangeStats:
        """Run every bucket through the pipeline of the module note.

        - ``piece(i)``: this rank's flat piece of unit ``i`` (``dtype``, ``local_numel(i)``
          elements), called just before unit ``i``'s bucket is sent (for empty pieces too);
        - ``compute(bucket, fulls)``: on the owner, ``fulls[i]`` is unit ``i``'s whole flat data
          for every unit of the bucket owned here; returns the flat results (same dtype, numel);
        - ``apply(bucket, pieces)``: ``pieces[i]`` is this rank's piece of unit ``i``'s result
          for every unit of the bucket (views of a receive buffer, valid during the call);
        - ``present[i]``: this rank has data for unit ``i`` this step (the presence note; used
          with ``flags``): a unit present on some ranks only raises ``MixedPresenceError`` on
          every rank (on CPU; a device-side assert elsewhere), named by ``names(i)``;
        - ``overlap()``: called once the first gathers are in flight.
        """
        plan, group, dtype, device = self.plan, self.group, self.dtype, self.device
        layouts = self.layouts
        flagged = present if self.flags else None
        stats = ExchangeStats()
        me = plan.coord
        gathers: dict[int, tuple[dist.Work | None, torch.Tensor]] = {}
        scatters: deque[tuple[int, dist.Work | None, torch.Tensor]] = deque()

        def start_gather(b: int) -> None:
            lay = layouts[b]
            pieces = {i: piece(i) for i in plan.buckets[b].units}
            send = lay.pack_gather(pieces, flagged, device)
            recv = torch.empty(sum(lay.gather_recv), dtype=torch.uint8, device=device)
            gathers[b] = (_a2a(recv, send, lay.gather_recv, lay.gather_send, group), recv)
            stats.collectives += 1
            stats.bytes_sent += sum(n for d, n in enumerate(lay.gather_send) if d != me)

        def owner_side(b: int) -> None:
            lay = layouts[b]
            work, recv = gathers.pop(b)
            if work is not None:
                work.wait()
            fulls, status = lay.unpack_gather(recv, dtype)
            results = compute(plan.buckets[b], fulls) if lay.mine else {}
            send = lay.pack_scatter(results, status, device)
            back = torch.empty(sum(lay.scatter_recv), dtype=torch.uint8, device=device)
            scatters.append((b, _a2a(back, send, lay.scatter_recv, lay.scatter_send, group), back))
            stats.collectives += 1
            stats.bytes_sent += sum(n for k, n in enumerate(lay.scatter_send) if k != me)

        def finish_scatter() -> None:
            b, work, back = scatters.popleft()
            if work is not None:
                work.wait()
            pieces, statuses = layouts[b].unpack_scatter(back, dtype)
            if statuses is not None:
                bucket = plan.buckets[b]
                order = [i for owned in bucket.owned for i in owned]
                check_presence(statuses, order, self.what, self.names)
            apply(plan.buckets[b], pieces)

        ahead = max(1, in_flight)
        for b in range(min(ahead, len(plan.buckets))):
            start_gather(b)
        if overlap is not None:
            overlap()
        for b in range(len(plan.buckets)):
            owner_side(b)
            if b + ahead < len(plan.buckets):
                start_gather(b + ahead)
            while len(scatters) > 1:
                finish_scatter()
        while scatters:
            finish_scatter()
        return stats


def plan_owner_exchange(
    group: dist.ProcessGroup,
    coord: int,
    ranges: Sequence[Sequence[tuple[int, int]]],
    owners: Sequence[int],
    *,
    weights: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    bucket_cap_mb: float,
    check: bool,
    what: str,
    names: Callable[[int], str],
    description: object,
    tensors: Sequence[str],
    count: int,
) -> OwnerExchange:
    """The owner exchange of units with ``ranges`` to ``owners`` over ``group`` (this rank at
    ``coord``), in buckets of about ``bucket_cap_mb`` of ``dtype`` payload, each owner's
    ``weights`` spread evenly over them.

    With ``check``, presence flags travel with the data, and every rank must have planned the
    same exchange: one agreement all-gather of ``fingerprint(description)`` and ``count``
    (``agree``); a mismatch raises on every rank, naming this rank's ``tensors``. Both
    optimizers with an owner exchange (Muon, Shampoo / SOAP) make theirs here, once per
    layout.
    """
    total = dtype.itemsize * sum(r[-1][1] for r in ranges if r)
    count_buckets = bucket_count(total, owners, bucket_cap_mb)
    plan = plan_exchange(coord, ranges, owners, buckets=count_buckets, weights=weights)
    if check:
        check_agreement(group, fingerprint(description), count, device, what, list(tensors))
    return OwnerExchange(
        plan, group, dtype=dtype, device=device, flags=check, what=what, names=names
    )
