"""Copying a state dict off the training tensors for an asynchronous save.

[Note: staging]
An asynchronous save must not write from the training tensors: the next optimizer step changes
them while the writer reads. ``stage_state_dict`` copies every tensor to CPU memory and returns
a state dict of the same structure over the copies (DTensors keep their spec; other values are
deep-copied on the calling thread), as DCP's stager does, but by storage: the tensors that view
one storage (a group's flat shard, a flat optimizer state) are copied as one span, the bytes
from the first to the last element any of them covers, and become views of the copy at the
same relative offsets. CPU tensors are copied on the calling thread, at once (the CPU/gloo
behaviour). Device tensors follow [Note: staging without a stall].

[Note: staging without a stall]
FSDP2 + ``dcp.async_save`` puts the device-to-host copy in front of the next step; here it
overlaps the next forward and backward, and only the writers of the staged tensors wait:

- the calling thread records, per device, a ``ready`` event on that device's current stream
  (the stream the last writes were issued on: under an enclosing ``torch.cuda.stream`` context
  that stream, not the default one) and hands the copies to a stager thread. It allocates
  nothing: the staged state dict's device tensors are empty placeholders, given their host
  storage by the stager thread (``set_``) before anyone may read them;
- the stager thread takes pinned host buffers (reused across saves: one save at a time, and a
  model's spans are the same every save; the first save allocates them, off the training
  thread), makes each device's copy stream wait on ``ready``, issues the copies on it and
  records a ``done`` event per device on that device's copy stream, an event of *that* device
  (never the current device's current stream: a parameter may live on another GPU);
- the next writers of the staged tensors are the optimizer steps (the sharded parameters and
  the optimizer state are what ``step`` overwrites; forward and backward only read them). A
  global optimizer step pre-hook makes each device's current stream, at the step, wait on its
  ``done`` event; the step is the only kernel that waits for the copy. Anything else that
  writes the live parameters or optimizer state in place before the save's ``result()`` (a
  ``load_state_dict``, a manual update outside an optimizer) must call ``wait_staged_writes``
  first;
- the stager thread keeps the source storages referenced until the writer has synchronized on
  the ``done`` events (``StagedStateDict.wait``), so the caching allocator never hands memory
  the copy stream still reads to the compute stream;
- the writer's ``release`` returns the pinned buffers to the pool after the write.

Simulated streams on CPU check the protocol (``tests/test_engine_checkpoint_staging_streams.py``
plants each hazard): ``_copy_stream`` and ``_submit`` are the two seams the test replaces.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import _disable_current_modes

from ragged_dtensor import own_storage_view, storage_base

__all__ = ["StagedStateDict", "stage_state_dict", "wait_staged_writes"]

_ALIGN = 64  # bytes: a span starts aligned for any dtype the storage is viewed in

Key = tuple[str, int]


def _plain(tensor: torch.Tensor) -> bool:
    return type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter


def _leaves(value: Any) -> Iterator[torch.Tensor]:
    """Every plain tensor a copy is made of (DTensors: their local tensors)."""
    if isinstance(value, DTensor):
        yield value._local_tensor
    elif isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _leaves(item)


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[start, stop)`` bytes of the tensor's base storage it covers (it has elements): the
    storage its own was cut from, for a parameter's or a gradient's local tensor (ragged_dtensor's
    ``storage_base``), so a group's tensors are still copied as one span."""
    size = tensor.element_size()
    extent = 1 + sum((int(n) - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    start = storage_base(tensor)[1] + int(tensor.storage_offset()) * size
    return start, start + extent * size


def _storage_key(tensor: torch.Tensor) -> Key:
    return str(tensor.device), storage_base(tensor)[0].data_ptr()


def _bytes_of(source: torch.Tensor, begin: int, stop: int) -> torch.Tensor:
    """A uint8 view of ``source``'s storage, bytes ``[begin, stop)``. Building a view touches
    no data: a dispatch mode watching accesses (the simulated streams) must not count it."""
    with _disable_current_modes():
        raw = torch.empty(0, dtype=torch.uint8, device=source.device)
        return raw.set_(storage_base(source)[0], begin, (stop - begin,), (1,))


def _view_into(target: torch.Tensor, buffer: torch.Tensor, like: tuple[Any, ...]) -> None:
    """Point the placeholder ``target`` at ``buffer`` (``like``: offset, shape, stride)."""
    offset, shape, stride = like
    with _disable_current_modes():
        target.set_(buffer.untyped_storage(), offset, shape, stride)
        # over storage of its own, at offset 0 ([Note: views over storage of their own] in
        # ragged_dtensor): saved and copied as its own elements only
        own = own_storage_view(target) if target.numel() else target
        if own is not target:
            target.set_(own.untyped_storage(), 0, shape, stride)


# -- the device path: streams, pinned buffers, the stager thread ---------------------------------

_COPY_STREAMS: dict[torch.device, torch.Stream] = {}


def _copy_stream(device: torch.device) -> torch.Stream | None:
    """``device``'s device-to-host copy stream (one per device), None without streams (CPU:
    the copy is made on the calling thread, as before)."""
    if device.type in {"cpu", "meta"}:
        return None
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.Stream(device=device)
    return stream


class _PinnedPool:
    """Pinned host buffers by byte size, reused across saves (taken and given back by the
    stager and writer threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: dict[tuple[int, bool], list[torch.Tensor]] = {}

    def take(self, nbytes: int, pinned: bool) -> torch.Tensor:
        with self._lock:
            free = self._free.get((nbytes, pinned))
            if free:
                return free.pop()
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def give(self, buffers: list[torch.Tensor]) -> None:
        with self._lock:
            for buffer in buffers:
                key = (buffer.numel(), buffer.is_pinned())
                self._free.setdefault(key, []).append(buffer)


_POOL = _PinnedPool()
_EXECUTOR: ThreadPoolExecutor | None = None


def _submit(job: Callable[[], None]) -> Future[None]:
    """Run ``job`` on the stager thread (tests with simulated streams run it inline)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fsdp_engine-stager")
    return _EXECUTOR.submit(job)


class _DeviceCopies:
    """The device spans of one staging: issued by the stager thread, guarded, waited, released."""

    def __init__(self) -> None:
        # (source bytes, pinned?, stream, device, placeholders [(tensor, (offset, shape, stride))])
        self.spans: list[tuple[torch.Tensor, bool, torch.Stream, torch.device, list[Any]]] = []
        self.ready: dict[torch.device, torch.Event] = {}
        self.done: dict[torch.device, torch.Event] = {}
        self.buffers: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.issued: Future[None] | None = None
        self.finished = False  # the writer synchronized on every done event

    def issue(self) -> None:
        """The stager thread's job: buffers, the copies on each device's copy stream after its
        ``ready`` event, a ``done`` event of that device on that stream."""
        waited: set[torch.device] = set()
        try:
            for source, pinned, stream, device, placeholders in self.spans:
                host = _POOL.take(source.numel(), pinned)
                self.buffers.append(host)
                if device not in waited:
                    stream.wait_event(self.ready[device])
                    waited.add(device)
                with stream:  # sets the stream's device too
                    host.copy_(source, non_blocking=pinned)
                for target, like in placeholders:
                    _view_into(target, host, like)
        except BaseException as exc:  # the writer raises it; the guard still waits on what ran
            self.error = exc
        finally:
            for _source, _, stream, device, _ in self.spans:
                if device in waited and device not in self.done:
                    event = torch.Event(device=device)
                    event.record(stream)
                    self.done[device] = event

    def guard(self) -> None:
        """Make each device's current stream wait for the copies (before an optimizer step)."""
        if self.finished or self.issued is None:
            return
        self.issued.result()  # the host waits for the stager to have issued, not for the copy
        for device, event in self.done.items():
            torch.accelerator.current_stream(device).wait_event(event)

    def wait(self) -> None:
        if self.issued is not None:
            self.issued.result()
        for event in self.done.values():
            event.synchronize()
        self.finished = True
        self.spans.clear()  # the copies landed: the sources may be freed and reused
        if self.error is not None:
            raise self.error

    def release(self) -> None:
        buffers, self.buffers = self.buffers, []
        if self.finished and self.error is None:
            _POOL.give(buffers)


_GUARDS: list[_DeviceCopies] = []
_GUARD_HOOK: Any = None


def wait_staged_writes() -> None:
    """Order the current streams after every staging copy still in flight; what an in-place
    write of staged tensors outside an optimizer step calls first ([Note: staging without a
    stall])."""
    for copies in list(_GUARDS):
        copies.guard()


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    wait_staged_writes()


def _guard(copies: _DeviceCopies) -> None:
    """Guard the next optimizer steps with ``copies`` (this thread: the training thread)."""
    global _GUARD_HOOK
    _GUARDS[:] = [g for g in _GUARDS if not g.finished]
    _GUARDS.append(copies)
    if _GUARD_HOOK is None:
        _GUARD_HOOK = register_optimizer_step_pre_hook(_before_step)


# -- the staging ---------------------------------------------------------------------------------


class StagedStateDict:
    """A CPU copy of a state dict; device copies may be in flight until ``wait()``."""

    def __init__(self, state_dict: dict[str, Any], copies: _DeviceCopies) -> None:
        self.state_dict = state_dict
        self._copies = copies

    def wait(self) -> None:
        """Block until every device-to-host copy landed (the writer calls this first)."""
        self._copies.wait()

    def release(self) -> None:
        """The write is over: the pinned buffers go back to the pool (after ``wait``)."""
        self._copies.release()


class _Stager:
    """One staging: spans planned from every tensor, one copy each, then views of the copies."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        spans: dict[Key, list[int]] = {}
        for tensor in _leaves(state_dict):
            if not _plain(tensor) or tensor.numel() == 0:
                continue
            start, stop = _byte_range(tensor)
            span = spans.setdefault(_storage_key(tensor), [start, stop])
            span[0], span[1] = min(span[0], start), max(span[1], stop)
        self._sources: dict[Key, torch.Tensor] = {}
        for tensor in _leaves(state_dict):
            key = _storage_key(tensor) if _plain(tensor) and tensor.numel() else None
            if key is not None and key not in self._sources:
                self._sources[key] = tensor
        self._copies: dict[Key, tuple[int, torch.Tensor]] = {}
        self._deferred: dict[Key, tuple[int, list[Any]]] = {}
        self.device = _DeviceCopies()
        for key, (start, stop) in spans.items():
            source = self._sources[key]
            begin = start - start % _ALIGN
            stream = _copy_stream(source.device)
            if stream is None:  # on the calling thread, at once
                host = torch.empty(stop - begin, dtype=torch.uint8)
                host.copy_(_bytes_of(source, begin, stop))
                self._copies[key] = (begin, host)
                continue
            placeholders: list[Any] = []
            self._deferred[key] = (begin, placeholders)
            pinned = source.device.type != "cpu"
            self.device.spans.append(
                (_bytes_of(source, begin, stop), pinned, stream, source.device, placeholders)
            )
            if source.device not in self.device.ready:
                # the last writes were issued on this device's current stream (an enclosing
                # stream context's, if any): an event of this device, on that stream
                event = torch.Event(device=source.device)
                event.record(torch.accelerator.current_stream(source.device))
                self.device.ready[source.device] = event

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _plain(tensor):  # another subclass: its own copy to the CPU
            return tensor.detach().to("cpu", copy=True)
        if tensor.numel() == 0:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        key = _storage_key(tensor)
        start, _ = _byte_range(tensor)
        deferred = self._deferred.get(key)
        if deferred is not None:  # the stager thread gives it its storage
            begin, placeholders = deferred
            with _disable_current_modes():
                target = torch.empty(0, dtype=tensor.dtype)
            offset = (start - begin) // tensor.element_size()
            placeholders.append((target, (offset, tuple(tensor.shape), tuple(tensor.stride()))))
            return target
        begin, buffer = self._copies[key]
        view = torch.empty(0, dtype=tensor.dtype)
        offset = (start - begin) // tensor.element_size()
        return view.set_(buffer.untyped_storage(), offset, tensor.shape, tensor.stride())

    def value(self, value: Any) -> Any:
        if isinstance(value, DTensor):
            # over storage of its own, at offset 0: saved and copied as its own elements, its
            # wrapper's data_ptr() 0 ([Note: a DTensor's data_ptr] in ragged_dtensor's compat)
            local = own_storage_view(self.tensor(value._local_tensor))
            return DTensor(local, value._spec, requires_grad=False)  # type: ignore[no-untyped-call]
        if isinstance(value, torch.Tensor):
            return self.tensor(value)
        if isinstance(value, Mapping):
            return {key: self.value(item) for key, item in value.items()}
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, tuple):
            items = [self.value(item) for item in value]
            named: Any = type(value)  # a namedtuple rebuilds from its fields
            return named._make(items) if hasattr(value, "_fields") else tuple(items)
        if value is None or isinstance(value, int | float | complex | str | bytes | bool):
            return value
        return copy.deepcopy(value)


def stage_state_dict(state_dict: Mapping[str, Any]) -> StagedStateDict:
    """A CPU copy of ``state_dict`` (see [Note: staging]); device copies may still be in
    flight until ``.wait()``."""
    stager = _Stager(state_dict)
    staged = {key: stager.value(item) for key, item in state_dict.items()}
    copies = stager.device
    if copies.spans:
        copies.issued = _submit(copies.issue)
        _guard(copies)
    return StagedStateDict(staged, copies)
