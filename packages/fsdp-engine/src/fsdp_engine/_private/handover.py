"""How autograd's unsharded gradients reach a group's reduce-scatter input.

[Note: gradient hand-over]
The reduce-scatter reads one flat unsharded gradient storage per group, whose slices are the
parameters' gradients. Three ways to fill it, measured side by side (``benchmarks/
bench_engine.py --handover``: bytes read and written by the step's ops, peak live memory;
dense medium / its parameter-bound variant at world 2):

- ``PrezeroedHandover``: allocate the storage before the group's backward, zero it and attach
  its slices as the unsharded parameters' ``.grad``: autograd accumulates into them in place
  (a memset, the kernel's write, then autograd's add: two reads and a write). 915.5 / 378.7 MiB
  moved, peak 83.80 / 38.93 MiB.
- ``TakeHandover``: a post-accumulate hook copies each gradient into its slice as autograd makes
  it and drops autograd's tensor; the storage is allocated at the group's first gradient, never
  zeroed but for the gaps and the slices no gradient reached. 889.1 / 352.3 MiB moved, peak
  83.80 / 38.84 MiB: the whole storage is allocated at the start of the group's backward, when
  the activations are at their largest.
- ``HoldHandover`` (the default): autograd's gradients stay on the unsharded parameters through
  the group's backward (FSDP2's way); post-backward, after the unsharded parameters were freed,
  copies them into the storage, allocated then, and drops them. The same 889.1 / 352.3 MiB
  moved as ``TakeHandover``, peak 81.20 / 37.42 MiB (FSDP2: 1237.8 / 701.0 MiB, 81.21 / 37.42).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from fsdp_engine._private import compat
from fsdp_engine._private.storage import ShardStorage, gap_index

__all__ = [
    "Handover",
    "HoldHandover",
    "PrezeroedHandover",
    "TakeHandover",
    "handover_casts",
    "handover_for",
]


class Handover:
    """Fills ``grads``' unsharded storage with the group's gradients."""

    casts = True  # may the storage be in another dtype than the gradients (the reduce dtype)?

    def __init__(self, storage: ShardStorage, grads: DBuffer, dtype: torch.dtype) -> None:
        self.storage = storage
        self.grads = grads
        self.dtype = dtype
        self._views: list[torch.Tensor] | None = None
        self.taken = [False] * len(storage.shapes)  # a gradient arrived in this window
        self._hooked: dict[int, weakref.ref[nn.Parameter]] = {}

    def _hook(self, unsharded: Sequence[nn.Parameter]) -> None:
        """A post-accumulate hook on each unsharded parameter (once per parameter object)."""
        for i, param in enumerate(unsharded):
            seen = self._hooked.get(id(param))
            if (seen is not None and seen() is param) or not param.requires_grad:
                continue
            param.register_post_accumulate_grad_hook(self._on_grad(i))  # type: ignore[no-untyped-call]
            self._hooked[id(param)] = weakref.ref(param)

    def _on_grad(self, i: int) -> Callable[[nn.Parameter], None]:
        def hook(param: nn.Parameter) -> None:
            self.taken[i] = True

        return hook

    def views(self) -> list[torch.Tensor]:
        """Each parameter's slice of the storage (its full shape; made once)."""
        if self._views is None:
            self._views = list(self.storage.full_views(self.grads, self.dtype))
        return self._views

    def prepare(self, unsharded: Sequence[nn.Parameter]) -> None:
        """Before the group's backward (every backward of an accumulation window)."""
        raise NotImplementedError

    def collect(self, unsharded: Sequence[nn.Parameter]) -> list[bool]:
        """After the group's backward: the storage holds the window's gradients (allocated,
        zeros where none came); returns which parameters got one on this rank."""
        raise NotImplementedError

    def detach(self, unsharded: Sequence[nn.Parameter]) -> None:
        """Before the storage is released: autograd holds nothing of it."""
        for param in unsharded:
            param.grad = None


class PrezeroedHandover(Handover):
    casts = False  # autograd accumulates into the storage: the gradients' dtype

    def prepare(self, unsharded: Sequence[nn.Parameter]) -> None:
        self._hook(unsharded)
        if not self.grads.is_unsharded():
            self.grads.alloc_unsharded(zero=True)
            self.taken = [False] * len(self.taken)
        views = self.views()
        for i, (param, view) in enumerate(zip(unsharded, views, strict=True)):
            param.grad = self.storage.unsharded_view(i, view)

    def collect(self, unsharded: Sequence[nn.Parameter]) -> list[bool]:
        return list(self.taken)


class TakeHandover(Handover):
    def __init__(self, storage: ShardStorage, grads: DBuffer, dtype: torch.dtype) -> None:
        super().__init__(storage, grads, dtype)
        self.written = [False] * len(storage.shapes)  # the slice holds this window's values
        self._gaps: torch.Tensor | None = None

    def prepare(self, unsharded: Sequence[nn.Parameter]) -> None:
        self._hook(unsharded)

    def _on_grad(self, i: int) -> Callable[[nn.Parameter], None]:
        def take(param: nn.Parameter) -> None:
            grad = param.grad
            if grad is None:
                return
            self._write(i, compat.local_tensor(grad) if isinstance(grad, DTensor) else grad)
            param.grad = None  # autograd's tensor goes now: only the storage holds the gradient

        return take

    def _allocate(self) -> None:
        """The storage for a new window: allocated, not written but for the gaps between
        the slices (the reduce-scatter reads them; zero, like a zeroed storage's)."""
        self.grads.alloc_unsharded()
        self.written = [False] * len(self.written)
        self.taken = [False] * len(self.taken)
        gaps = self._gap_index()
        if gaps.numel():
            self.grads.unsharded_flat().index_fill_(0, gaps, 0)

    def _gap_index(self) -> torch.Tensor:
        if self._gaps is None:
            flat = self.grads.unsharded_flat()
            base = int(flat.storage_offset())
            spans = [(int(v.storage_offset()) - base, v.numel()) for v in self.views()]
            self._gaps = gap_index(spans, flat.numel(), flat.device)
        return self._gaps

    def _write(self, i: int, grad: torch.Tensor) -> None:
        if not self.grads.is_unsharded():
            self._allocate()
        view = self.views()[i]
        with torch.no_grad():
            if self.written[i]:
                view.add_(grad.view(view.shape))
            else:
                view.copy_(grad.view(view.shape))
        self.written[i] = self.taken[i] = True

    def collect(self, unsharded: Sequence[nn.Parameter]) -> list[bool]:
        for i, param in enumerate(unsharded):  # gradients no hook took (a hook removed...)
            if param.grad is not None:
                grad = param.grad
                self._write(i, compat.local_tensor(grad) if isinstance(grad, DTensor) else grad)
                param.grad = None
        if not self.grads.is_unsharded():
            self.grads.alloc_unsharded(zero=True)  # no gradient at all on this rank
            self.taken = [False] * len(self.taken)
        else:
            with torch.no_grad():
                for view, written in zip(self.views(), self.written, strict=True):
                    if not written:
                        view.zero_()
        self.written = [True] * len(self.written)  # zeros are values: a next microbatch adds
        return list(self.taken)


class HoldHandover(TakeHandover):
    """Autograd's gradients stay on the unsharded parameters through the group's backward
    (FSDP2's way); post-backward copies them into the storage, allocated then, and drops them."""

    def prepare(self, unsharded: Sequence[nn.Parameter]) -> None:
        pass  # no hook: the gradients are collected after the backward

    def collect(self, unsharded: Sequence[nn.Parameter]) -> list[bool]:
        return super().collect(unsharded)  # takes every .grad, then zeroes the rest


# the hand-over new groups use ([Note: gradient hand-over]; the benchmark switches it)
DEFAULT: type[Handover] = HoldHandover


def handover_for(storage: ShardStorage, grads: DBuffer, dtype: torch.dtype) -> Handover:
    return DEFAULT(storage, grads, dtype)


def handover_casts() -> bool:
    """Whether the default hand-over writes the storage in a dtype of its own choosing."""
    return DEFAULT.casts
