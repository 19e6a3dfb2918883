"""Owner assignment: which rank does the whole-tensor work of each unit, balanced by cost.

[Note: balancing several costs at once]
A non-elementwise optimizer (Muon's Newton-Schulz, a Shampoo root, an eigendecomposition) needs
each unit (a matrix, an expert matrix, a preconditioner block) whole on one rank, its *owner*.
The owner pays two costs per unit: compute (e.g. NS flops) and memory (the gathered matrix and
its workspace, or a preconditioner kept there). Balancing only one of them can pile the other on
one rank: a few large square matrices are flop-heavy but small, many thin ones the reverse.

``assign_owners`` takes one cost vector per unit (any number of dimensions, the same for every
unit) and normalizes each dimension by its total, so that every dimension's ideal per-rank load
is ``1 / world``. Greedy (multi-dimensional longest-processing-time): units by decreasing
largest normalized cost, each onto the rank whose load after taking it has the smallest largest
dimension; ties go to the smaller total, then to the rank already holding the most of the unit
(less traffic), then to the lowest rank. With one dimension this is classic LPT (makespan within
4/3 of optimal). Deterministic: every rank computes the same owners from the same global
description, so no communication is needed to agree on them.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["assign_owners"]


def assign_owners(
    costs: Sequence[Sequence[float]], shares: Sequence[Sequence[int]]
) -> tuple[int, ...]:
    """An owner rank for every unit, balancing each cost dimension over ranks.

    ``costs[i]``: unit ``i``'s cost vector (e.g. ``(flops, bytes)``); ``shares[i][k]``: elements
    of unit ``i`` rank ``k`` already holds (its length is the number of ranks).
    """
    if not costs:
        return ()
    world = len(shares[0])
    dims = len(costs[0])
    if any(len(c) != dims for c in costs) or any(len(s) != world for s in shares):
        raise ValueError(
            "assign_owners: every unit needs a cost vector of the same length and one share "
            f"per rank (got cost lengths {sorted({len(c) for c in costs})}, share lengths "
            f"{sorted({len(s) for s in shares})})"
        )
    if any(x < 0 for c in costs for x in c):
        raise ValueError("assign_owners: costs must be >= 0")
    totals = [float(sum(c[d] for c in costs)) for d in range(dims)]
    scale = [1.0 / t if t > 0 else 0.0 for t in totals]
    load = [[0.0] * dims for _ in range(world)]
    owners = [0] * len(costs)

    def peak(i: int) -> float:
        return max(costs[i][d] * scale[d] for d in range(dims)) if dims else 0.0

    for i in sorted(range(len(costs)), key=lambda j: (-peak(j), j)):
        c = costs[i]

        def after(
            k: int, c: Sequence[float] = c, held: Sequence[int] = shares[i]
        ) -> tuple[float, float, int, int]:
            new = [(load[k][d] + c[d]) * scale[d] for d in range(dims)]
            return (max(new, default=0.0), sum(new), -held[k], k)

        best = min(range(world), key=after)
        owners[i] = best
        for d in range(dims):
            load[best][d] += c[d]
    return tuple(owners)
