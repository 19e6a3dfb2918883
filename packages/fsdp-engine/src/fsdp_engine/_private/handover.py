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

[Note: gradients in the parameters' storage]
Opt-in (``FSDPModule.set_gradients_in_parameter_storage``), ``InPlaceHandover``: on a step that
reduces and reshards after backward, each gradient overwrites its own unsharded parameter as
soon as autograd has accumulated it (a post-accumulate hook copies it there and drops autograd's
tensor), and the reduce-scatter reads the unsharded parameter storage itself. No layer's
gradients are ever held beside its parameters: the peak of a parameter-bound backward drops by
one layer's gradients (bench_engine's ``in-place gradients`` rows).

Why it is sound: autograd runs a parameter's AccumulateGrad only after every node that sends it
a gradient has run, and those are the nodes that use it; the value is read by nothing else of
this backward unless the model uses a detached alias of its own weight (``w.detach()``,
``w.data``, a view under ``no_grad``) saved for backward: such a read raises or falls back,
never reads the gradient silently ([Note: reading an overwritten weight] in
``in_place_guard.py``). It is skipped (the gradient stays, ``HoldHandover``'s way) when the
hook runs in another backward than the one the group's pre-backward armed (a reentrant
checkpoint's nested pass) or under ``create_graph`` (the gradient's own graph may read the
parameter), and never armed for mixed precision (the storage must be in the reduce dtype),
for no-sync microbatches, without ``reshard_after_backward`` or for groups whose unsharded
memory is not one plain all-gathered buffer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer
from fsdp_engine._private import compat
from fsdp_engine._private.in_place_guard import bump_version, consume_data_reads
from fsdp_engine._private.storage import ShardStorage, gap_index

__all__ = [
    "Handover",
    "HoldHandover",
    "InPlaceHandover",
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
            self._gaps = _gaps(self.grads.unsharded_flat(), self.views())
        return self._gaps

    def _write(self, i: int, grad: torch.Tensor) -> None:
        if not self.grads.is_unsharded():
            self._allocate()
        view = self.views()[i]
        with torch.no_grad():
            _accumulate(view, grad, add=self.written[i])
        self.written[i] = self.taken[i] = True

    def collect(self, unsharded: Sequence[nn.Parameter]) -> list[bool]:
        """The gradients no hook took (all of them without hooks) into the storage: one
        foreach copy (and one foreach add for a later microbatch's), zeros where none came."""
        taken = [(i, p.grad) for i, p in enumerate(unsharded) if p.grad is not None]
        if taken and not self.grads.is_unsharded():
            self._allocate()
        views = self.views() if taken else []
        copy: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        add: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, grad in taken:
            local = compat.local_tensor(grad) if isinstance(grad, DTensor) else grad
            into = add if self.written[i] else copy
            into[0].append(views[i])
            into[1].append(local.view(views[i].shape))
            self.written[i] = self.taken[i] = True
            unsharded[i].grad = None
        with torch.no_grad():
            if copy[0]:
                torch._foreach_copy_(copy[0], copy[1])
            if add[0]:
                torch._foreach_add_(add[0], add[1])
        if not self.grads.is_unsharded():
            self.grads.alloc_unsharded(zero=True)  # no gradient at all on this rank
            self.taken = [False] * len(self.taken)
        else:
            unwritten = [v for v, w in zip(self.views(), self.written, strict=True) if not w]
            if unwritten:
                with torch.no_grad():
                    torch._foreach_zero_(unwritten)
        self.written = [True] * len(self.written)  # zeros are values: a next microbatch adds
        return list(self.taken)


class HoldHandover(TakeHandover):
    """Autograd's gradients stay on the unsharded parameters through the group's backward
    (FSDP2's way); post-backward copies them into the storage, allocated then, and drops them."""

    def prepare(self, unsharded: Sequence[nn.Parameter]) -> None:
        pass  # no hook: ``collect`` takes every .grad after the backward, then zeroes the rest


class InPlaceHandover(HoldHandover):
    """[Note: gradients in the parameters' storage]: ``arm`` before a group's backward makes
    each gradient overwrite its unsharded parameter; unarmed, ``HoldHandover``."""

    def __init__(self, storage: ShardStorage, grads: DBuffer, dtype: torch.dtype) -> None:
        super().__init__(storage, grads, dtype)
        self.target: torch.Tensor | None = None  # the unsharded parameters' flat storage
        self._target_views: Sequence[torch.Tensor] = ()
        self._task = -1
        self._target_gaps: torch.Tensor | None = None
        self._warned: set[str] = set()  # parameters whose .data reads were warned about

    @property
    def armed(self) -> bool:
        return self.target is not None

    def arm(
        self, flat: torch.Tensor, views: Sequence[torch.Tensor], unsharded: Sequence[nn.Parameter]
    ) -> None:
        """Before the group's backward: its gradients go into ``views`` (slices of ``flat``);
        unless the forward read ``.data`` of one of ``unsharded`` ([Note: reading an
        overwritten weight]): then ``HoldHandover``'s way for this backward."""
        if consume_data_reads(unsharded, self._warned, list(self.storage.names)):
            self.disarm()
            return
        if self.target is not flat:
            self._target_gaps = None
        self.target, self._target_views = flat, views
        self.written = [False] * len(self.written)
        self.taken = [False] * len(self.taken)
        self._task = compat.graph_task_id()
        self._hook(unsharded)

    def disarm(self) -> None:
        self.target, self._target_views = None, ()

    def _on_grad(self, i: int) -> Callable[[nn.Parameter], None]:
        def overwrite(param: nn.Parameter) -> None:
            grad = param.grad
            if grad is None or self.target is None or torch.is_grad_enabled():
                return  # unarmed, or create_graph: the gradient stays (collect copies it)
            if compat.graph_task_id() != self._task:
                return  # a nested backward (reentrant checkpoint): the outer one may read it
            self._overwrite(i, grad)
            param.grad = None  # autograd's tensor goes now
            bump_version(param)  # [Note: reading an overwritten weight]

        return overwrite

    def _overwrite(self, i: int, grad: torch.Tensor) -> None:
        view = self._target_views[i]
        local = compat.local_tensor(grad) if isinstance(grad, DTensor) else grad
        # the parameters' views share one version counter: kept, as for an all-gather's write
        with compat.no_grad_and_preserved(view):
            _accumulate(view, local, add=self.written[i])
        self.written[i] = self.taken[i] = True

    def collect(self, unsharded: Sequence[nn.Parameter]) -> list[bool]:
        if self.target is None:
            return super().collect(unsharded)
        target = self.target
        for i, param in enumerate(unsharded):  # gradients the hook left (nested, create_graph)
            if param.grad is not None:
                self._overwrite(i, param.grad)
                param.grad = None
                bump_version(param)  # a retained graph's next backward must not read it
        with compat.no_grad_and_preserved(target):
            for view, written in zip(self._target_views, self.written, strict=True):
                if not written:
                    view.zero_()  # a parameter without a gradient: a zero contribution
            gaps = self._gaps_of(target)
            if gaps.numel():
                target.index_fill_(0, gaps, 0)
        self.written = [True] * len(self.written)
        self.disarm()
        return list(self.taken)

    def _gaps_of(self, flat: torch.Tensor) -> torch.Tensor:
        if self._target_gaps is None:
            self._target_gaps = _gaps(flat, self._target_views)
        return self._target_gaps


def _gaps(flat: torch.Tensor, views: Sequence[torch.Tensor]) -> torch.Tensor:
    """The indices of ``flat`` no view covers (padding, alignment gaps)."""
    base = int(flat.storage_offset())
    spans = [(int(v.storage_offset()) - base, v.numel()) for v in views]
    return gap_index(spans, flat.numel(), flat.device)


def _accumulate(view: torch.Tensor, grad: torch.Tensor, *, add: bool) -> None:
    """``view`` gets ``grad`` (a microbatch after the first adds; caller holds no_grad)."""
    if add:
        view.add_(grad.view(view.shape))
    else:
        view.copy_(grad.view(view.shape))


# the hand-over new groups use ([Note: gradient hand-over]; the benchmark switches it): unarmed,
# InPlaceHandover is HoldHandover
DEFAULT: type[Handover] = InPlaceHandover


def handover_for(storage: ShardStorage, grads: DBuffer, dtype: torch.dtype) -> Handover:
    return DEFAULT(storage, grads, dtype)


def handover_casts() -> bool:
    """Whether the default hand-over writes the storage in a dtype of its own choosing."""
    return DEFAULT.casts
