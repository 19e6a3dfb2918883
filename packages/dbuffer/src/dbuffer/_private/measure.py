"""Measurement utilities: live storage bytes and bytes copied, seen from the dispatcher.

[Note: why a dispatch-mode tally]
No CPU allocator statistics exist in torch 2.13 and RSS is useless for this. Every tensor op passes
through the dispatcher, so a ``TorchDispatchMode`` sees each new storage an op creates; a weakref
finalizer on the storage object sees it die (torch keeps one Python object per live StorageImpl).
Memory freed or re-allocated by ``UntypedStorage.resize_`` (how FSDP2 and DBuffer free unsharded
storage while keeping views valid) does not go through an op, so ``resize_`` is wrapped while a
tally is active. Kernel temporaries (e.g. inside a gloo collective) are not seen; the profiler's
memory events are the exact reference and this tally matched them on op outputs.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["CopiedBytes", "LiveBytes"]

_LOCK = threading.RLock()
_ACTIVE: weakref.WeakSet[LiveBytes] = weakref.WeakSet()
_ORIGINAL_RESIZE: Callable[..., Any] | None = None


def _storage_key(storage: torch.UntypedStorage) -> int:
    return int(storage._cdata)


def _storage_of(value: Any) -> int | None:
    """The storage identity of a plain dense tensor (None for subclasses, sparse, meta)."""
    if type(value) is not torch.Tensor or value.layout != torch.strided:
        return None
    if value.device.type == "meta":
        return None
    return _storage_key(value.untyped_storage())


def _patched_resize(self: torch.UntypedStorage, size: int) -> Any:
    assert _ORIGINAL_RESIZE is not None
    result = _ORIGINAL_RESIZE(self, size)
    with _LOCK:
        for tally in list(_ACTIVE):
            tally._on_resize(self)
    return result


def _install_resize_hook(tally: LiveBytes) -> None:
    global _ORIGINAL_RESIZE
    with _LOCK:
        if _ORIGINAL_RESIZE is None:
            _ORIGINAL_RESIZE = torch.UntypedStorage.resize_
            torch.UntypedStorage.resize_ = _patched_resize  # type: ignore[method-assign,assignment]
        _ACTIVE.add(tally)


def _remove_resize_hook(tally: LiveBytes) -> None:
    global _ORIGINAL_RESIZE
    with _LOCK:
        _ACTIVE.discard(tally)
        if not _ACTIVE and _ORIGINAL_RESIZE is not None:
            torch.UntypedStorage.resize_ = _ORIGINAL_RESIZE  # type: ignore[method-assign]
            _ORIGINAL_RESIZE = None


class LiveBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Tally of live tensor-storage bytes while active (a context manager).

    ``current`` is the bytes held now by the storages it knows: those of ``seed`` tensors plus
    every storage an op created inside the context; ``peak`` is the largest ``current`` seen.
    A storage stops counting when it dies or is resized to 0 (``UntypedStorage.resize_`` is
    accounted), and counts again when resized back. ``device`` restricts the tally to one device
    type (e.g. ``"cuda"``); meta tensors never count.

    Example::

        with LiveBytes(seed=model.parameters()) as live:
            loss = model(x).sum()
            loss.backward()
        print(live.peak, live.current)
    """

    def __init__(self, *, seed: Iterable[torch.Tensor] = (), device: str | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._device = device
        self._sizes: dict[int, int] = {}
        self._thread = threading.get_ident()
        self.current = 0
        self.peak = 0
        for tensor in seed:
            self.track(tensor)

    # -- bookkeeping ----------------------------------------------------------------------------
    def _counts(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "meta":
            return False
        return self._device is None or tensor.device.type == self._device

    def track(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage from now on (no-op if it is already counted)."""
        if not self._counts(tensor):
            return
        self._track_storage(tensor.untyped_storage())

    def _track_storage(self, storage: torch.UntypedStorage) -> None:
        key = _storage_key(storage)
        with _LOCK:
            if key in self._sizes:
                return
            self._sizes[key] = storage.nbytes()
            self._add(storage.nbytes())
        weakref.finalize(storage, _release, weakref.ref(self), key)

    def _add(self, delta: int) -> None:
        self.current += delta
        self.peak = max(self.peak, self.current)

    def _forget(self, key: int) -> None:
        with _LOCK:
            size = self._sizes.pop(key, None)
            if size is not None:
                self.current -= size

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        key = _storage_key(storage)
        if key in self._sizes:
            old = self._sizes[key]
            self._sizes[key] = storage.nbytes()
            self._add(storage.nbytes() - old)
        elif (
            threading.get_ident() == self._thread
            and storage.device.type != "meta"
            and (self._device is None or storage.device.type == self._device)
        ):
            self._track_storage(storage)

    def reset_peak(self) -> None:
        """Start a new peak measurement from the current tally."""
        self.peak = self.current

    # -- dispatch -------------------------------------------------------------------------------
    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        inputs = {_storage_of(t) for t in tree_leaves((args, kwargs))}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and self._counts(t):
                key = _storage_of(t)
                if key is not None and key not in inputs:
                    self._track_storage(t.untyped_storage())
        return out

    def __enter__(self) -> LiveBytes:
        _install_resize_hook(self)
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        super().__exit__(exc_type, exc, tb)  # type: ignore[no-untyped-call]
        _remove_resize_hook(self)


def _release(ref: weakref.ref[LiveBytes], key: int) -> None:
    tally = ref()
    if tally is not None:
        tally._forget(key)


def _nbytes(t: Any) -> int:
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def _all_bytes(value: Any) -> int:
    return sum(_nbytes(t) for t in tree_leaves(value))


# op name -> how to count the bytes it writes: "out" (its outputs or out= tensors), "self" (the
# tensors it writes in place, first argument) or "src" (its input list, for copy-in kernels).
_COPY_OPS: dict[str, str] = {
    "aten::copy_": "self",
    "aten::_to_copy": "out",
    "aten::clone": "out",
    "aten::cat": "out",
    "aten::stack": "out",
    "aten::split_with_sizes_copy": "out",
    "aten::_chunk_cat": "out",
    "aten::_foreach_copy_": "self",
    "aten::index_copy": "out",
    "aten::index_copy_": "self",
    "aten::contiguous": "out",
    "fsdp::all_gather_copy_in": "src",
    "fsdp::split_with_sizes_copy": "out",
    "fsdp::chunk_cat": "out",
}


class CopiedBytes(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Tally of bytes written by copy-like ops while active (a context manager).

    Counts the destination bytes of ``copy_``, casts (``_to_copy``), ``clone``, ``cat``,
    ``split_with_sizes_copy``, ``_chunk_cat``, ``_foreach_copy_`` and FSDP2's own
    ``fsdp::all_gather_copy_in`` / ``split_with_sizes_copy`` / ``chunk_cat`` kernels. ``by_op``
    breaks ``total`` down per op name. Collectives are not copies and are not counted.
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.total = 0
        self.by_op: dict[str, int] = {}

    def __torch_dispatch__(
        self,
        func: Any,
        types: Sequence[type],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        how = _COPY_OPS.get(name)
        if how is not None:
            if how in {"self", "src"}:
                written = _all_bytes(args[0])
            else:
                written = _all_bytes(kwargs["out"]) if "out" in kwargs else _all_bytes(out)
            self.total += written
            self.by_op[name] = self.by_op.get(name, 0) + written
        return out

    def __enter__(self) -> CopiedBytes:
        super().__enter__()  # type: ignore[no-untyped-call]
        return self
