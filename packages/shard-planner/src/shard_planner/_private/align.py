"""Aligned tensor starts: every offset a multiple of ``offset_align`` elements.

[Note: why offsets, not only shard sizes]
``align`` makes every shard size, hence every rank's shard start ``k*S``, a multiple of the
collective's unit. The tensors inside the buffer start wherever the packing put them, so a
parameter's full view (and its share inside a shard) may begin at an odd element: fine for
correctness, but GEMMs and multi-tensor kernels on GPUs want 16-byte aligned pointers, and
compilers guard on it. With ``offset_align`` (dividing ``align``) every tensor starts on a
multiple of it too, so every view of the buffer, in any dtype whose item size divides
``16 / offset_align``-byte steps, is 16-byte aligned.

[Note: the earliest aligned start]
The greedy's rule (``greedy`` [Note: the earliest feasible start, in closed form]) with two
changes, for alignment ``a`` dividing ``S``: the position is first rounded up to a multiple of
``a``; and where the rule steps back from boundary ``b`` by whole blocks (``(b - l) % g == 0``),
``l`` must also be a multiple of ``a``, and ``b`` is one, so it steps by ``L = lcm(g, a)``:
``l1 = p + (b - p) % L`` and ``l3 = b + S % L``. The validity tests (does the tensor reach
``b + S``, is ``S`` a multiple of ``g``) are the greedy's. The same argument as there makes the
earliest aligned start optimal for a fixed order.

[Note: the pass]
``aligned_plan`` starts from what a method chose (its placement order and shard size ``S0``) and
re-places the tensors in that order at their earliest aligned starts. If they no longer fit (the
alignment gaps pushed the end past ``m * S0``), the static orders (``orders`` [Note: the static
orders]) are tried at the same size; failing those, the result is the smallest multiple of
``align`` above ``S0`` at which one of those orders fits ([Note: the smallest size that fits]).
One self-contained pass after any method, so every method honours the parameter the same way;
a plan whose offsets are aligned already is kept as it is.

[Note: the aligned end, gap by gap]
Every aligned start is a multiple of ``a``, so a tensor that fits before the next boundary is
followed by a start exactly ``round_up(e, a)`` later. With ``C_j`` the sum of ``round_up(e_i, a)``
over the non-empty tensors before ``j`` (in the order) and ``D_j = C_j + e_j``, the tensors from
``j`` on start at ``p + C_k - C_j`` until the first ``k`` with ``D_k > b - p + C_j`` would cross
the boundary ``b``; ``D`` is non-decreasing, so that ``k`` is one bisection. Only that tensor
needs the closed-form rule (``aligned_start``), and each such event moves past at least one
boundary, so one test of a shard size costs ``O(min(m, n) log n)`` after an ``O(n)`` prefix sum
per order, instead of ``n`` start computations. The end is ``E(S) = D_last + G(S)``, where
``G(S)`` sums the gaps the events leave: in case 2 of the rule ``(b - p') mod L`` with
``L = lcm(g, a)``, at most ``L - a`` (``b - p'`` and ``L`` are multiples of ``a``); case 3 (a
tensor longer than ``S`` whose block does not divide ``S``) can leave up to about ``S``.

[Note: the smallest size that fits]
Feasibility is **not** monotone in ``S`` (12 elements of block 4 over 3 ranks fit at ``S`` = 4
and 8, not at 5 to 7), so bisecting ``S`` on it could step over the smallest size that fits.
Two conditions are monotone and in closed form, and bracket the answer:

* necessary: ``m * S >= min over orders of D_last``, since every gap is ``>= 0``;
* sufficient: ``m * S >= min over orders of D_last + H`` and ``S >= N``, where ``H`` is the sum
  of the ``m - 1`` largest ``L_i - a`` and ``N`` the largest tensor whose block does not divide
  ``align``. Proof: with ``S >= N`` every tensor longer than ``S`` has ``g | S`` (``S`` is a
  multiple of ``align``), so case 3 never happens and each event's gap is at most ``L - a``.
  Each event passes a distinct boundary; if the greedy overflowed ``m * S``, take the first
  tensor to do so: before it at most ``m - 1`` events happened (boundaries ``S .. (m-1)S``), so
  its end is at most ``D_last + H <= m * S``, a contradiction.

Both sides grow with ``S``, so the first size meeting each is a closed form. When every block
divides ``offset_align`` (the engine's default block of one element), ``H = 0`` and ``N = 0``,
the two coincide and the answer is that closed form: one test instead of the previous pass's
one greedy per ``align`` step (5,001 greedy passes over 10,000 tensors for 5,000
``Linear(2, 2)`` at two ranks). Otherwise the sizes between the two are tested upwards (a
window of at most ``max(L) / align`` sizes, plus the sizes up to ``N``); past a work budget
(``WINDOW_BUDGET`` boundary events; counted, never timed, so every rank plans the same), the
rest of the window is bisected with "fits" at the upper end as the invariant: the result then
fits and the size below it does not, but a smaller one might. Within the budget the result is
the smallest size ``>= S0`` at which one of the orders fits, so never larger than what the
previous pass (which skipped sizes) returned.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Sequence

import attrs

from shard_planner._private.bounds import round_up
from shard_planner._private.orders import static_orders
from shard_planner._private.plan import Plan

__all__ = ["WINDOW_BUDGET", "aligned_end", "aligned_greedy", "aligned_plan", "aligned_start"]

# Boundary events (module [Note: the aligned end, gap by gap]) the upward scan of the window may
# spend before it bisects the rest: about a second of Python, counted, never timed.
WINDOW_BUDGET = 500_000


def aligned_start(p: int, numel: int, block: int, shard_size: int, offset_align: int) -> int | None:
    """Smallest feasible start ``>= p`` that is a multiple of ``offset_align`` (module Note),
    or ``None`` if no start works for this shard size."""
    s = shard_size
    p = round_up(p, offset_align)
    b = (p // s + 1) * s
    if p + numel <= b:
        return p
    step = math.lcm(block, offset_align)
    l1 = p + (b - p) % step
    if s % block == 0 or l1 + numel <= b + s:
        return l1
    l3 = b + s % step
    if l3 + numel <= b + 2 * s:
        return l3
    return None


def aligned_greedy(
    numels: Sequence[int],
    blocks: Sequence[int],
    order: Sequence[int],
    shard_size: int,
    world_size: int,
    offset_align: int,
) -> tuple[dict[int, int] | None, int]:
    """Aligned offsets of the tensors in ``order`` (``None`` if they overflow ``m * S``), and the
    end the greedy reached (the first end past ``m * S`` when it overflows). One start
    computation per tensor: the placement itself; ``aligned_end`` decides fits faster."""
    capacity = world_size * shard_size
    offsets: dict[int, int] = {}
    p = 0
    for i in order:
        if numels[i] == 0:
            # Nothing to hold; an aligned position inside the buffer, as the methods do.
            offsets[i] = min(p, capacity - 1) // offset_align * offset_align
            continue
        at = aligned_start(p, numels[i], blocks[i], shard_size, offset_align)
        if at is None:
            return None, capacity + shard_size + p + numels[i]
        p = at + numels[i]
        if p > capacity:
            return None, p
        offsets[i] = at
    return offsets, p


@attrs.frozen
class _Run:
    """One order's non-empty tensors with the prefix sums of [Note: the aligned end, gap by
    gap]: ``starts[j]`` is ``C_j``, ``ends[j]`` is ``D_j`` (non-decreasing)."""

    numels: tuple[int, ...]
    blocks: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]

    @classmethod
    def of(cls, numels: Sequence[int], blocks: Sequence[int], order: Sequence[int], a: int) -> _Run:
        es = [numels[i] for i in order if numels[i] > 0]
        gs = [blocks[i] for i in order if numels[i] > 0]
        starts, ends, c = [], [], 0
        for e in es:
            starts.append(c)
            ends.append(c + e)
            c += round_up(e, a)
        return cls(tuple(es), tuple(gs), tuple(starts), tuple(ends))

    @property
    def bare_end(self) -> int:
        """The end with no gap but the rounding of each start to ``a``: ``D_last``."""
        return self.ends[-1] if self.ends else 0


def aligned_end(run: _Run, shard_size: int, world_size: int, a: int) -> tuple[int | None, int]:
    """The aligned greedy's end for ``run`` at ``shard_size`` (``None`` if it overflows ``m * S``
    or a tensor has no start), and the boundary events it took (its work): the same answer as
    ``aligned_greedy``, in ``O(min(m, n) log n)`` (module [Note: the aligned end, gap by gap])."""
    e, g, c, d = run.numels, run.blocks, run.starts, run.ends
    n, s = len(e), shard_size
    capacity = world_size * s
    j, p, end, events = 0, 0, 0, 0
    while j < n:
        if p >= capacity:
            return None, events
        b = (p // s + 1) * s
        k = bisect_right(d, b - p + c[j], j)
        if k == n:  # the rest fits before b (<= capacity)
            return p + d[n - 1] - c[j], events
        events += 1
        at = aligned_start(p + c[k] - c[j], e[k], g[k], s, a)
        if at is None or at + e[k] > capacity:
            return None, events
        end = at + e[k]
        p = at + round_up(e[k], a)
        j = k + 1
    return end, events


def _first_fitting(runs: Sequence[_Run], shard: int, m: int, a: int) -> tuple[int | None, int]:
    """The first of ``runs`` that fits at ``shard``, and the work spent finding out."""
    work = 0
    for index, run in enumerate(runs):
        end, events = aligned_end(run, shard, m, a)
        work += events + 1
        if end is not None:
            return index, work
    return None, work


def _smallest_fitting(
    runs: Sequence[_Run], numels: Sequence[int], blocks: Sequence[int], plan: Plan, a: int
) -> tuple[int, int]:
    """The smallest multiple of ``align`` above the plan's shard size at which one of ``runs``
    fits, and that run's index (module [Note: the smallest size that fits])."""
    m, align = plan.world_size, plan.align
    trivial = round_up(sum(numels) + len(numels) * a, align)  # everything fits in shard 0
    bare = min(run.bare_end for run in runs)
    gaps = [math.lcm(g, a) - a for e, g in zip(numels, blocks, strict=True) if e > 0]
    worst = sum(heapq.nlargest(m - 1, gaps)) if m > 1 else 0
    pairs = zip(numels, blocks, strict=True)
    longest = max((e for e, g in pairs if e > 0 and align % g), default=0)
    lo = max(plan.shard_size + align, round_up(-(-bare // m), align))
    hi = min(trivial, max(lo, round_up(max(-(-(bare + worst) // m), longest), align)))
    work, shard = 0, lo
    while shard < hi and work <= WINDOW_BUDGET:
        found, spent = _first_fitting(runs, shard, m, a)
        if found is not None:
            return shard, found
        work += spent
        shard += align
    good, bad = hi, shard - align  # bad: tested, does not fit (or below lo: cannot)
    found, _ = _first_fitting(runs, good, m, a)
    assert found is not None, "the sufficient condition of the Note guarantees a fit"
    while good - bad > align:
        mid = bad + (good - bad) // align // 2 * align
        at, _ = _first_fitting(runs, mid, m, a)
        if at is None:
            bad = mid
        else:
            good, found = mid, at
    return good, found


def aligned_plan(plan: Plan, offset_align: int) -> Plan:
    """``plan`` with every tensor's offset a multiple of ``offset_align`` (module Note: the
    pass). ``offset_align`` must divide the plan's ``align``."""
    a = offset_align
    if a < 1 or plan.align % a:
        raise ValueError(
            f"offset_align {offset_align} must be >= 1 and divide align {plan.align} (shard "
            f"boundaries must be aligned for tensor starts to be)"
        )
    if all(off % a == 0 for off in plan.offsets):
        return attrs.evolve(plan, offset_align=a)
    numels, blocks, m = plan.numels, plan.blocks, plan.world_size
    nonempty = [i for i in plan.order if numels[i] > 0]
    empty = [i for i in plan.order if numels[i] == 0]
    orders = [plan.order]
    orders += [(*o, *empty) for o in static_orders(numels, blocks, nonempty)]
    runs = [_Run.of(numels, blocks, order, a) for order in orders]
    shard = plan.shard_size
    chosen, _ = _first_fitting(runs, shard, m, a)
    if chosen is None:
        shard, chosen = _smallest_fitting(runs, numels, blocks, plan, a)
    offsets, _ = aligned_greedy(numels, blocks, orders[chosen], shard, m, a)
    assert offsets is not None, "aligned_end and aligned_greedy agree on what fits"
    full = tuple(offsets[i] for i in range(len(numels)))
    return Plan(
        world_size=m,
        shard_size=shard,
        align=plan.align,
        numels=numels,
        blocks=blocks,
        names=plan.names,
        offsets=full,
        order=tuple(sorted(range(len(numels)), key=lambda i: (full[i], numels[i] > 0, i))),
        method=plan.method,
        optimal=plan.optimal and shard == plan.shard_size,
        offset_align=a,
    )
