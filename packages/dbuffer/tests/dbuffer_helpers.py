"""Helpers shared by dbuffer's tests (module name unique across the repo)."""

from __future__ import annotations

import functools
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

_LOCAL = threading.local()
_WRAPPED = (
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "all_gather",
    "reduce_scatter",
    "broadcast",
)


def _counts() -> Counter[str]:
    if not hasattr(_LOCAL, "counts"):
        _LOCAL.counts = Counter()
    counts: Counter[str] = _LOCAL.counts
    return counts


def _wrap(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _counts()[name] += 1
        return fn(*args, **kwargs)

    wrapper.__dbuffer_counting__ = True  # type: ignore[attr-defined]
    return wrapper


def install_collective_counter() -> None:
    """Count, per thread, every call of the tensor collectives of ``torch.distributed``.

    Works with the threaded process group, whose collectives do not pass through the dispatcher.
    """
    for name in _WRAPPED:
        fn = getattr(dist, name)
        if not getattr(fn, "__dbuffer_counting__", False):
            setattr(dist, name, _wrap(name, fn))


def collective_counts() -> Counter[str]:
    """A snapshot of this thread's collective calls since ``reset_collective_counts``."""
    return Counter(_counts())


def reset_collective_counts() -> None:
    _counts().clear()


class DispatchedOps(TorchDispatchMode):
    """Every op that reaches the dispatcher, by name (c10d collectives included on gloo)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))

    def collectives(self) -> list[str]:
        return [op for op in self.ops if op.startswith("c10d.")]

    def compute(self) -> list[str]:
        """Non-collective ops, without views/metadata-only ops."""
        skip = (
            "aten.view",
            "aten.split",
            "aten.slice",
            "aten.as_strided",
            "aten.alias",
            "aten.detach",
            "aten.narrow",
            "aten._unsafe_view",
        )
        return [op for op in self.ops if not op.startswith("c10d.") and not op.startswith(skip)]


def make_tensors(
    shapes: Sequence[Sequence[int]], seed: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(tuple(s), generator=gen).to(dtype) for s in shapes]


# A small LLaMA-ish group: norms, projections with odd sizes, an empty one, a bias, a scalar.
SHAPES: list[tuple[int, ...]] = [
    (16,),
    (24, 16),
    (8, 16),
    (0, 16),
    (37, 16),
    (16, 37),
    (5,),
    (3, 2, 4),
    (),
]
BLOCKS: list[int] = [1, 16, 16, 16, 16, 37, 1, 8, 1]
