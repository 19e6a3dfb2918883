"""Tensors of equal (numel, block) are interchangeable: orders as multiset permutations, and the
best order of a whole group found by a dynamic programme over multisets.

[Note: kinds]
Two tensors with the same numel and block behave identically in every placement, so the planner
works with *kinds*: the distinct (numel, block) pairs with their multiplicities ``c_1..c_K``. The
distinct orders of ``n`` tensors number ``n! / (c_1! ... c_K!)``; ``multiset_orders`` lists them
directly (lexicographic successor on the sequence of kinds, O(n) per order), never walking the
``n!`` permutations.

[Note: the best end over all orders, without listing them]
For one shard size S let ``f_k(p)`` be the end of a tensor of kind ``k`` placed at its earliest
feasible start at or after ``p`` (``greedy`` Note). ``f_k`` is non-decreasing in ``p``. For a
multiset of tensors ``T`` let ``E(T)`` be the smallest greedy end over all orders of ``T``. Then

    E(empty) = 0,    E(T) = min over kinds k in T of f_k(E(T - k)).

(``>=``: any order of ``T`` ends with some kind ``k`` after an order of ``T - k`` that ends at
least at ``E(T - k)``, and ``f_k`` is monotone. ``<=``: the minimising ``k`` after the best order
of ``T - k`` is an order of ``T``.) Some order fits in ``m*S`` iff ``E(all) <= m*S``, and
following the minimising choices back gives such an order. The states are the count vectors
``0 <= t_k <= c_k``: ``prod(c_k + 1)`` of them, against ``n! / prod(c_k!)`` orders (7 distinct
tensors: 128 states against 5040 orders; 8 equal tensors and 3 others: 72 against 990; with
repeats the gap grows without bound). The programme runs layer by layer (states with the same
number of tensors), each step vectorised over states and shard sizes at once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from shard_planner._private.greedy import step_ends

__all__ = ["BestOrder", "Kinds", "distinct_order_count", "multiset_orders"]


class Kinds:
    """The kinds of the tensors ``indices`` (first-occurrence order) and their members."""

    def __init__(self, numels: Sequence[int], blocks: Sequence[int], indices: Sequence[int]):
        members: dict[tuple[int, int], list[int]] = {}
        for i in indices:
            members.setdefault((numels[i], blocks[i]), []).append(i)
        self.keys = list(members)
        self.members = [members[k] for k in self.keys]
        self.counts = [len(m) for m in self.members]

    @property
    def size(self) -> int:
        return sum(self.counts)

    @property
    def states(self) -> int:
        """Count vectors of the dynamic programme: ``prod(c_k + 1)``."""
        return math.prod(c + 1 for c in self.counts)

    def order_count(self) -> int:
        """Distinct orders: the multinomial ``n! / prod(c_k!)`` (computed as a product of
        binomials, exact)."""
        total, placed = 1, 0
        for c in self.counts:
            placed += c
            total *= math.comb(placed, c)
        return total

    def orders(self) -> Iterator[tuple[int, ...]]:
        """Every distinct order, as tensor indices (members of a kind keep their input order)."""
        sequence = [k for k, c in enumerate(self.counts) for _ in range(c)]
        for kinds in multiset_orders(sequence):
            yield self.order_of_kinds(kinds)

    def order_of_kinds(self, kinds: Sequence[int]) -> tuple[int, ...]:
        """Tensor indices for a sequence of kinds (the j-th use of a kind: its j-th member)."""
        taken = [0] * len(self.counts)
        out = []
        for k in kinds:
            out.append(self.members[k][taken[k]])
            taken[k] += 1
        return tuple(out)


def distinct_order_count(
    numels: Sequence[int], blocks: Sequence[int], indices: Sequence[int]
) -> int:
    """Multinomial count of distinct orders (tensors of equal numel and block are alike)."""
    return Kinds(numels, blocks, indices).order_count()


def multiset_orders(sequence: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every distinct permutation of ``sequence``, in lexicographic order (each once).

    The classical successor: find the last ``i`` with ``a[i] < a[i+1]``, swap ``a[i]`` with the
    last element larger than it, reverse the tail. Repeated values make equal permutations
    coincide, so each distinct one is produced exactly once, O(n) apart.
    """
    a = sorted(sequence)
    n = len(a)
    while True:
        yield tuple(a)
        i = n - 2
        while i >= 0 and a[i] >= a[i + 1]:
            i -= 1
        if i < 0:
            return
        j = n - 1
        while a[j] <= a[i]:
            j -= 1
        a[i], a[j] = a[j], a[i]
        a[i + 1 :] = reversed(a[i + 1 :])


class BestOrder:
    """``E(all)`` of the module Note for many shard sizes at once, and a minimising order.

    ``dtype``/``infeasible`` come from ``bounds.int_mode`` (exact integers at any size).
    """

    def __init__(self, kinds: Kinds, dtype: type, infeasible: int) -> None:
        self.kinds = kinds
        self.dtype = dtype
        self.infeasible = infeasible
        counts = kinds.counts
        # mixed radix: state index = sum t_k * radix_k
        self.radix = [math.prod(c + 1 for c in counts[:k]) for k in range(len(counts))]
        grid = np.indices([c + 1 for c in counts]).reshape(len(counts), -1)
        # np.indices is C-ordered (last coordinate fastest): re-index to our radix
        index = sum(grid[k] * self.radix[k] for k in range(len(counts)))
        order = np.argsort(index)
        coords = grid[:, order]  # coords[:, state]
        level = coords.sum(axis=0)
        self.layers = [np.flatnonzero(level == t) for t in range(kinds.size + 1)]
        # For each layer and kind: the positions (within the layer) of the states holding that
        # kind, and the states one tensor of that kind fewer (their predecessors).
        self.steps: list[list[tuple[int, npt.NDArray[np.intp], npt.NDArray[np.intp]]]] = []
        for layer in self.layers[1:]:
            per_kind = []
            for k in range(len(counts)):
                where = np.flatnonzero(coords[k, layer] > 0)
                if where.size:
                    per_kind.append((k, where, layer[where] - self.radix[k]))
            self.steps.append(per_kind)
        self.e: list[npt.NDArray[Any]] = [np.array([key[0]], dtype=dtype) for key in kinds.keys]
        self.g: list[npt.NDArray[Any]] = [np.array([key[1]], dtype=dtype) for key in kinds.keys]

    @property
    def work(self) -> int:
        """Kernel steps per shard size (the planner's budgets count these)."""
        return self.kinds.states * len(self.kinds.counts)

    def _run(self, sizes: npt.NDArray[Any], keep: bool) -> tuple[npt.NDArray[Any], list[Any]]:
        s = sizes[None, :]
        width = sizes.shape[0]
        best: npt.NDArray[Any] = np.zeros((self.kinds.states, width), dtype=np.int64).astype(
            self.dtype
        )
        choice: list[Any] = []
        # a kind the state lacks must never win, not even against infeasible ends
        absent = self.infeasible + 1
        for layer, per_kind in zip(self.layers[1:], self.steps, strict=True):
            low: npt.NDArray[Any] = np.full((layer.shape[0], width), absent, dtype=self.dtype)
            pick = np.zeros((layer.shape[0], width), dtype=np.intp) if keep else None
            for k, where, prev in per_kind:
                ends = step_ends(best[prev], self.e[k], self.g[k], s, self.infeasible)
                if pick is not None:
                    better = ends < low[where]
                    pick[where] = np.where(better, k, pick[where])
                low[where] = np.minimum(low[where], ends)
            best[layer] = low
            if pick is not None:
                choice.append((layer, pick))
        return best[-1], choice

    def ends(self, sizes: npt.NDArray[Any]) -> npt.NDArray[Any]:
        """The smallest greedy end over all orders, for each shard size in ``sizes``."""
        return self._run(sizes, keep=False)[0]

    def order(self, shard: int) -> tuple[int, ...]:
        """An order of the tensors whose greedy end at ``shard`` is the smallest possible."""
        _, choice = self._run(np.array([shard], dtype=self.dtype), keep=True)
        state = self.kinds.states - 1
        kinds: list[int] = []
        for layer, pick in reversed(choice):
            position = int(np.searchsorted(layer, state))
            k = int(pick[position, 0])
            kinds.append(k)
            state -= self.radix[k]
        return self.kinds.order_of_kinds(kinds[::-1])
