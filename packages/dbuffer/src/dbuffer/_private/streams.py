"""The communication streams of a device, and the one rule for memory used across streams.

[Note: streams and frees without record_stream]
On an accelerator, all-gathers run on one all-gather stream per device, reduce-scatters (and
their epilogue) on one reduce-scatter stream and the HSDP all-reduce on its own all-reduce
stream (FSDP2's three streams): a reduction never queues behind a prefetch, the replica
all-reduce of one layer overlaps the next layer's reduce-scatter, and none of them waits for
compute it does not need. Each collective waits only on the events its data depends on:

- an all-gather on ``ready``, the event marking the last write of its input (the engine records
  one when an iteration starts, after the optimizer step), or without one on the caller's stream
  at issue time; the low-precision cast of the shard runs there too, off the compute stream;
- a reduce-scatter on the caller's stream at issue time (the gradients it reduces were just
  computed there); its temporaries (the reduce-dtype cast, the receive buffer) are allocated and
  written on the reduce-scatter stream; the all-reduce waits on the reduce-scatter's event.

After the collective and its epilogue an event is recorded on the last stream that ran it and
``Handle.wait`` makes the caller's stream wait on it.

The caching allocator ties every block to the stream it was allocated on and, once the host
frees it, assumes that stream's queued work is the only use: the block may be reused by that
stream at once, or given back to the device (``empty_cache``, an out-of-memory retry,
expandable segments unmapping) once that stream's work is done. Memory one stream allocated and
another used is therefore freed only after **the owning stream waited on an event of the
using stream** recorded after its last use (``hand_back``): the unsharded parameters (allocated
on the all-gather stream, read by compute) at ``reshard``, the all-gather's receive buffer after
a hook read it, the reduce-scatter's temporaries after the all-reduce stream and a user hook
used them. This is FSDP2's rule (its all-gather streams wait on the copy-out event before the
all-gather output is dropped) and what ``record_stream`` would achieve, without its deferred,
allocator-dependent frees: memory is released exactly when ``reshard`` or ``Handle.wait``
returns. On CPU (gloo) there are no streams and every call here is a no-op.

The protocol is checked on CPU against a model of streams, events and the caching allocator,
including blocks given back to the device (``tests/test_dbuffer_streams.py``, and the engine's
use of it in the repository's ``tests/test_integration_streams.py``). On a device, race checks
widen the windows through ``before_collective`` (``benchmarks/gpu_check.py``: a sleep kernel on
the communication stream before each collective, so a missing wait reads unfinished data).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Literal

import torch

__all__ = [
    "StreamKind",
    "before_collective",
    "collective_starts",
    "comm_stream_for",
    "current_stream",
    "event_after",
    "hand_back",
    "on_all_gather_stream",
    "on_stream",
    "ordered_after",
]

StreamKind = Literal["all_gather", "reduce_scatter", "all_reduce"]

before_collective: Callable[[StreamKind, torch.Stream | None], None] | None = None
"""Opt-in test hook, default None (nothing runs). When set, ``collective_starts`` calls it on
the host once per collective dbuffer issues (all-gather, reduce-scatter, replica all-reduce;
none where one rank copies instead), right before the issue, with the collective's kind and its
communication stream, which is then the current stream (None on devices without streams, where
collectives run in issue order). A race check sets it to enqueue a sleep kernel there
(``torch.cuda._sleep``), delaying the collective without changing what it computes."""

_COMM_STREAMS: dict[tuple[torch.device, str], torch.Stream] = {}
# FSDP2's priorities: the all-gather and reduce-scatter streams high, the all-reduce normal
_PRIORITY: dict[str, int] = {"all_gather": -1, "reduce_scatter": -1, "all_reduce": 0}


def comm_stream_for(device: torch.device, kind: StreamKind = "all_gather") -> torch.Stream | None:
    """The ``kind`` communication stream of ``device`` (one per device and kind, shared by all
    buffers), or None for devices without streams (CPU, meta)."""
    if device.type in {"cpu", "meta"}:
        return None
    stream = _COMM_STREAMS.get((device, kind))
    if stream is None:
        stream = torch.Stream(device=device, priority=_PRIORITY[kind])
        _COMM_STREAMS[(device, kind)] = stream
    return stream


def collective_starts(kind: StreamKind, stream: torch.Stream | None) -> None:
    """Called right before a collective of ``kind`` is issued on ``stream`` (the current one):
    runs ``before_collective`` if set."""
    hook = before_collective
    if hook is not None:
        hook(kind, stream)


def current_stream(device: torch.device) -> torch.Stream:
    return torch.accelerator.current_stream(device)


def event_after(stream: torch.Stream, device: torch.device) -> torch.Event:
    """An event marking how far ``stream`` has got."""
    event = torch.Event(device=device)
    event.record(stream)
    return event


def ordered_after(
    stream: torch.Stream | None, device: torch.device, ready: torch.Event | None
) -> None:
    """Make ``stream`` wait for ``ready`` (default: the caller's stream now)."""
    if stream is None:
        return
    if ready is None:
        ready = event_after(current_stream(device), device)
    stream.wait_event(ready)


def hand_back(owner: torch.Stream | None, device: torch.device) -> None:
    """Before freeing memory ``owner`` allocated and the caller's stream used: make ``owner``
    wait for every use the caller's stream has issued so far (module Note). A no-op without
    streams, or when the caller's stream is the owner."""
    if owner is None:
        return
    caller = current_stream(device)
    if caller == owner:
        return
    owner.wait_event(event_after(caller, device))


@contextlib.contextmanager
def on_stream(stream: torch.Stream | None) -> Iterator[None]:
    """``stream`` as the current stream for the body (nothing without streams)."""
    if stream is None:
        yield
        return
    with stream:
        yield


@contextlib.contextmanager
def on_all_gather_stream(device: torch.device, ready: torch.Event | None) -> Iterator[None]:
    """Run the body on ``device``'s all-gather stream once ``ready`` (default: the caller's
    stream now) has passed: the work a caller does to make an all-gather's input (FSDP2's
    pre-all-gather hooks and copy-in), off the compute stream. What the body allocates belongs
    to the all-gather stream's pool; the caller issues the all-gather next (on the same
    stream). Nothing changes on devices without streams."""
    stream = comm_stream_for(device, "all_gather")
    ordered_after(stream, device, ready)
    with on_stream(stream):
        yield
