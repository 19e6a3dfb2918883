"""Copying a state dict off the training tensors for an asynchronous save.

[Note: staging]
An asynchronous save must not write from the training tensors: the next optimizer step changes
them while the writer reads. ``stage_state_dict`` copies every tensor to CPU memory on the
calling thread and returns a state dict of the same structure over the copies (DTensors keep
their spec; other values are deep-copied), as DCP's stager does, but by storage: the tensors
that view one storage (a group's flat shard, a flat optimizer state) are copied as one span,
the bytes from the first to the last element any of them covers, and become views of the
copy at the same relative offsets. Device tensors are copied into pinned memory without
blocking; the returned event is what the writer waits on before it reads (the copies are
ordered on the current stream, before anything the training thread issues next).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor

from ragged_dtensor import own_storage_view, storage_base

__all__ = ["StagedStateDict", "stage_state_dict"]

_ALIGN = 64  # bytes: a span starts aligned for any dtype the storage is viewed in


@attrs.frozen
class StagedStateDict:
    """A CPU copy of a state dict and the device events its copies complete at."""

    state_dict: dict[str, Any]
    events: tuple[torch.Event, ...]

    def wait(self) -> None:
        """Block until every device-to-host copy landed (the writer calls this first)."""
        for event in self.events:
            event.synchronize()


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


def _storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    return str(tensor.device), storage_base(tensor)[0].data_ptr()


class _Stager:
    """One staging: spans planned from every tensor, one copy each, then views of the copies."""

    def __init__(self, state_dict: Mapping[str, Any]) -> None:
        spans: dict[tuple[str, int], list[int]] = {}
        for tensor in _leaves(state_dict):
            if not _plain(tensor) or tensor.numel() == 0:
                continue
            start, stop = _byte_range(tensor)
            span = spans.setdefault(_storage_key(tensor), [start, stop])
            span[0], span[1] = min(span[0], start), max(span[1], stop)
        self._copies: dict[tuple[str, int], tuple[int, torch.Tensor]] = {}
        self._sources: dict[tuple[str, int], torch.Tensor] = {}
        for tensor in _leaves(state_dict):
            key = _storage_key(tensor) if _plain(tensor) and tensor.numel() else None
            if key is not None and key not in self._sources:
                self._sources[key] = tensor
        devices: dict[str, torch.device] = {}
        for key, (start, stop) in spans.items():
            source = self._sources[key]
            begin = start - start % _ALIGN
            pinned = source.device.type != "cpu"
            raw = torch.empty(0, dtype=torch.uint8, device=source.device)
            raw.set_(storage_base(source)[0], begin, (stop - begin,), (1,))
            host = torch.empty(stop - begin, dtype=torch.uint8, pin_memory=pinned)
            host.copy_(raw, non_blocking=pinned)
            self._copies[key] = (begin, host)
            if pinned:
                devices[str(source.device)] = source.device
        events = []
        for device in devices.values():
            event = torch.Event(device=device)
            event.record()
            events.append(event)
        self.events = tuple(events)

    def tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        if not _plain(tensor):  # another subclass: its own copy to the CPU
            return tensor.detach().to("cpu", copy=True)
        if tensor.numel() == 0:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        begin, buffer = self._copies[_storage_key(tensor)]
        start, _ = _byte_range(tensor)
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
    return StagedStateDict(staged, stager.events)
