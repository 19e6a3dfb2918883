"""The single-process result of a reduction over dbuffer's test tensors, the error it may carry,
and the check of a buffer's shards against it (shared by the collectives and gloo tests)."""

from __future__ import annotations

import torch
from dbuffer_helpers import SHAPES, make_tensors

from dbuffer import DBuffer
from dbuffer.testing import sharded_views


class Expected:
    """The single-process result of a reduction and the error it may legitimately carry.

    Different arithmetic: the reference sums in float64 the values each rank sends (cast to the
    reduce dtype first, as the engine does); the process group sums n terms in the reduce dtype
    and the result is scaled and cast. Recursive summation of n terms errs by at most
    (n - 1) * u * sum|g| (u = eps / 2), the scale, the cast and an accumulation add one rounding
    each: ``bound = (n + 3) * eps * (scale * sum|g| + |initial|)`` with eps that of the coarser
    of the reduce and the buffer dtype.
    """

    def __init__(self, ranks: range, op: str, dtype: torch.dtype | None) -> None:
        self.terms = len(ranks)
        self.dtype = dtype
        self.values = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        self.magnitudes = [torch.zeros(s, dtype=torch.float64) for s in SHAPES]
        for r in ranks:
            for acc, mag, g in zip(
                self.values, self.magnitudes, make_tensors(SHAPES, 100 + r), strict=True
            ):
                sent = (g.to(dtype) if dtype is not None else g).double()
                acc.add_(sent)
                mag.add_(sent.abs())
        if op == "avg":
            self.values = [t / self.terms for t in self.values]
            self.magnitudes = [t / self.terms for t in self.magnitudes]

    def plus(self, initial: list[torch.Tensor]) -> Expected:
        """The result accumulated into ``initial`` (``accumulate=True``)."""
        for value, mag, i in zip(self.values, self.magnitudes, initial, strict=True):
            value.add_(i.double())
            mag.add_(i.double().abs())
        return self

    def bound(self, index: int, buffer_dtype: torch.dtype) -> torch.Tensor:
        eps = max(torch.finfo(d).eps for d in (buffer_dtype, self.dtype or buffer_dtype))
        return (self.terms + 3) * eps * self.magnitudes[index]


def reference(ranks: range, op: str, dtype: torch.dtype | None) -> Expected:
    return Expected(ranks, op, dtype)


def check_shards(buf: DBuffer, expected: Expected) -> None:
    for i, (dt, slot) in enumerate(zip(sharded_views(buf), buf.slots, strict=True)):
        rng = slot.placement.flat_range(slot.shape, buf.rank)
        want = expected.values[i].reshape(-1)[rng.start : rng.stop]
        bound = expected.bound(i, buf.dtype).reshape(-1)[rng.start : rng.stop]
        error = (dt.to_local().double() - want).abs()
        worst = int(torch.argmax(error - bound)) if error.numel() else 0
        assert bool((error <= bound).all()), (
            f"{slot.name}: element {worst} off by {error[worst].item():.3e}, "
            f"bound {bound[worst].item():.3e}"
        )
