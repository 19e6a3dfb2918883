"""The pure plan of an owner exchange (see ``exchange``): units cut into buckets that keep
every owner about equally busy, and what each rank sends and receives."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

__all__ = ["Bucket", "ExchangePlan", "ExchangeStats", "bucket_count", "plan_exchange"]


@attrs.frozen
class Bucket:
    """One round of the exchange: its units and this rank's element counts."""

    units: tuple[int, ...]
    """The bucket's units in exchange order: by owner, then by unit index."""
    owned: tuple[tuple[int, ...], ...]
    """Per rank: the units of this bucket it owns, in unit order."""
    send_counts: tuple[int, ...]
    """Gather: elements this rank sends to each rank (= receives from it in the scatter)."""
    recv_counts: tuple[int, ...]
    """Gather: elements this rank receives from each rank (= sends to it in the scatter)."""


@attrs.frozen
class ExchangePlan:
    """Who sends what to whom, for this rank (``coord``) of the axis."""

    coord: int
    world: int
    ranges: tuple[tuple[tuple[int, int], ...], ...]
    owners: tuple[int, ...]
    buckets: tuple[Bucket, ...]

    def local_numel(self, i: int) -> int:
        lo, hi = self.ranges[i][self.coord]
        return hi - lo

    def numel(self, i: int) -> int:
        return self.ranges[i][-1][1] if self.ranges[i] else 0

    @property
    def mine(self) -> tuple[int, ...]:
        """Units owned by this rank, in unit order."""
        return tuple(i for i, d in enumerate(self.owners) if d == self.coord)

    @property
    def moved_elements(self) -> int:
        """Elements this rank sends over the network per direction (own pieces excluded)."""
        return sum(n for b in self.buckets for d, n in enumerate(b.send_counts) if d != self.coord)


@attrs.define
class ExchangeStats:
    """What one ``run`` issued on this rank (for benchmarks and tests)."""

    collectives: int = 0
    bytes_sent: int = 0
    """Bytes put on the network by this rank (its own pieces excluded), both directions."""


def _chunks(units: Sequence[int], weights: Sequence[int], parts: int) -> list[list[int]]:
    """``units`` (in order) cut into ``parts`` consecutive chunks of about equal weight: a unit
    goes to chunk ``floor(parts * (weight before it + half its weight) / total)``."""
    out: list[list[int]] = [[] for _ in range(parts)]
    total = sum(weights[i] for i in units)
    before = 0
    for i in units:
        w = weights[i]
        b = min(parts - 1, (parts * (2 * before + w)) // (2 * total)) if total else 0
        out[b].append(i)
        before += w
    return out


def plan_exchange(
    coord: int,
    ranges: Sequence[Sequence[tuple[int, int]]],
    owners: Sequence[int],
    *,
    buckets: int = 1,
    weights: Sequence[int] | None = None,
) -> ExchangePlan:
    """The exchange of units with ``ranges`` (per unit, per rank) to ``owners`` in ``buckets``
    rounds; ``weights`` (default: numel) balance each owner's units over the buckets."""
    world = len(ranges[0]) if ranges else 1
    for i, r in enumerate(ranges):
        if len(r) != world or any(a > b for a, b in r):
            raise ValueError(f"plan_exchange: unit {i} has ranges {tuple(r)} for {world} ranks")
        if any(r[k][1] != r[k + 1][0] for k in range(world - 1)) or r[0][0] != 0:
            raise ValueError(f"plan_exchange: unit {i}'s ranges {tuple(r)} do not tile it")
    if any(not 0 <= d < world for d in owners) or len(owners) != len(ranges):
        raise ValueError(f"plan_exchange: owners {tuple(owners)} for {len(ranges)} units")
    sizes = [r[-1][1] for r in ranges]
    weight = list(weights) if weights is not None else sizes
    count = max(1, buckets)
    per_owner = [[i for i, d in enumerate(owners) if d == k] for k in range(world)]
    cut = [_chunks(units, weight, count) for units in per_owner]
    out = []
    for b in range(count):
        owned = tuple(tuple(cut[k][b]) for k in range(world))
        units = tuple(i for k in range(world) for i in owned[k])
        if not units:
            continue
        send = [0] * world
        recv = [0] * world
        for i in units:
            lo, hi = ranges[i][coord]
            send[owners[i]] += hi - lo
            if owners[i] == coord:
                for k, (a, z) in enumerate(ranges[i]):
                    recv[k] += z - a
        out.append(Bucket(units, owned, tuple(send), tuple(recv)))
    return ExchangePlan(
        coord,
        world,
        tuple(tuple((int(a), int(z)) for a, z in r) for r in ranges),
        tuple(int(d) for d in owners),
        tuple(out),
    )


def bucket_count(total_bytes: int, owners: Sequence[int], cap_mb: float) -> int:
    """Buckets of about ``cap_mb`` of payload: at least one, at most as many as the most units
    one rank owns (a bucket holds a chunk of every owner's units)."""
    most = max((list(owners).count(k) for k in set(owners)), default=1)
    return max(1, min(most, math.ceil(total_bytes / max(cap_mb * 2**20, 1.0))))
