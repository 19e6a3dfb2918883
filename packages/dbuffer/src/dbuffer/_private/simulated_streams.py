"""Simulated accelerator streams on CPU: a model of dbuffer's stream protocol, for tests.

``install_simulated_streams(monkeypatch)`` routes dbuffer's streams, events, allocations and
collectives to the calling rank's simulation; inside ``with simulated_streams() as sim:`` every
aten op is recorded, and ``sim.races`` lists the accesses no happens-before path orders,
``sim.accessed`` the streams that touched memory.

Without an accelerator, the protocol of [Note: streams and frees without record_stream]
(collectives.py) is checked on a model of it: simulated streams with vector clocks (an op issued
under a stream ticks that stream's clock, ``Event.record`` snapshots the clock, ``wait_event``
merges it), a dispatch mode that records which storage every aten op reads and writes and on
which stream (the collectives, which run inside the process group, are recorded by a wrapper:
the output written, the input read), and the caching allocator's reuse rule without
``record_stream``.

[Note: the caching allocator's per-stream pools]
CUDA's caching allocator associates every allocation with the stream current when it was made;
once the host frees it (the last tensor on the storage dies, or ``resize_(0)``), the block may be
handed to the next allocation *on that same stream* at once, never to another stream's
(c10/cuda/CUDACachingAllocator.cpp, its header: "Allocations are associated with a stream. Once
freed, blocks can be re-allocated on the same stream, but not on any other stream."). So the
model keeps one pool per stream: every allocation (a fresh op output, or dbuffer's ``_allocate``
regrowing an unsharded storage) belongs to the current stream's pool, and every access to it must
happen after every access, on another stream, to memory of that pool freed before the
allocation (any such block may be the one reused). The last access per stream summarises them
(an access ordered after it is ordered after the earlier ones). Frees are seen where dbuffer
frees (``_free``) and when a storage dies (a finalizer on it: storages keep their Python object
while they live); memory first seen without its allocation (made before the simulation) is the
compute stream's. An access that conflicts with an earlier one on another stream with no
happens-before path is a race.

[Note: memory given back to the device]
The allocator may also give a freed block back to the device (``empty_cache``, an out-of-memory
retry, expandable segments unmapping); it then only makes sure the block's *own* stream is done
with it, so any later allocation, on any stream, may get that memory. With ``give_back`` the model
checks this at every free: the owning pool's stream must already be ordered after every access
to the block on other streams (``streams.hand_back``), else the free is a race. Deferring that
wait to the next all-gather (the old protocol) passes the reuse model and fails this one.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from dbuffer._private import storage, streams


class Patcher(Protocol):
    """What ``install_simulated_streams`` needs of pytest's ``monkeypatch`` fixture."""

    def setattr(self, target: Any, name: str, value: Any, raising: bool = True) -> None: ...


Access = tuple[str, int]  # (stream name, its clock at the access)


class SimulatedStream:
    def __init__(self, sim: StreamSimulation, name: str) -> None:
        self.sim, self.name = sim, name
        self.clock: dict[str, int] = {name: 0}
        self.stream_id = id(self)

    def tick(self) -> Access:
        self.clock[self.name] += 1
        return (self.name, self.clock[self.name])

    def after(self, access: Access) -> bool:
        """Does this stream's next op happen after ``access``?"""
        return self.clock.get(access[0], 0) >= access[1]

    def wait_event(self, event: SimulatedEvent) -> None:
        for name, tick in event.clock.items():
            self.clock[name] = max(self.clock.get(name, 0), tick)

    def __enter__(self) -> SimulatedStream:
        self.sim.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.sim.stack.pop()


class SimulatedEvent:
    def __init__(self, device: Any = None, **_: Any) -> None:
        self.device = device
        self.clock: dict[str, int] = {}

    def record(self, stream: SimulatedStream | None = None) -> None:
        stream = stream or _sim().current()
        self.clock = dict(stream.clock)


class Memory:
    """One allocation: its pool, its last write and the reads since."""

    def __init__(self, pool: str, prior: dict[str, int]) -> None:
        self.pool = pool
        # per stream, the last access to memory of this pool freed before (a possible reuse)
        self.prior = prior
        self.write: Access | None = None
        self.reads: list[Access] = []


# allocations that touch no data: a reused block's first access is checked, not its handing out
_ALLOCATIONS = frozenset(
    {
        torch.ops.aten.empty.memory_format,
        torch.ops.aten.empty_strided.default,
        torch.ops.aten.new_empty.default,
        torch.ops.aten.new_empty_strided.default,
        torch.ops.aten.empty_like.default,
    }
)


class StreamSimulation:
    def __init__(self, *, give_back: bool = False) -> None:
        self.compute = SimulatedStream(self, "compute")
        self.stack: list[SimulatedStream] = [self.compute]
        self.comm: dict[str, SimulatedStream] = {}
        self.streams: dict[str, SimulatedStream] = {"compute": self.compute}
        self.give_back = give_back
        self.memory: dict[int, Memory] = {}
        self.freed: dict[str, dict[str, int]] = {}  # pool -> stream -> last access to freed memory
        self.races: list[str] = []
        self.accessed: set[str] = set()  # streams that touched memory
        self.finalizers: list[weakref.finalize[Any, Any]] = []

    def current(self) -> SimulatedStream:
        return self.stack[-1]

    def comm_stream(self, device: torch.device, kind: str = "all_gather") -> SimulatedStream:
        if kind not in self.comm:
            self.comm[kind] = self.stream(kind)
        return self.comm[kind]

    def stream(self, name: str) -> SimulatedStream:
        """A stream of its own (a user's side stream, or a communication stream)."""
        if name not in self.streams:
            self.streams[name] = SimulatedStream(self, name)
        return self.streams[name]

    def _key(self, t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata)

    def allocated(self, t: torch.Tensor) -> None:
        """``t``'s storage was just given memory from the current stream's pool."""
        pool = self.current().name
        self.memory[self._key(t)] = Memory(pool, dict(self.freed.get(pool, {})))

    def fresh(self, t: torch.Tensor) -> None:
        """An op's output with a new storage: allocated now, freed when the storage dies."""
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            return
        key = int(storage._cdata)
        stale = self.memory.pop(key, None)  # a storage that died unseen at this address
        if stale is not None:
            self._retire(stale)
        self.allocated(t)
        self._watch(storage, key)

    def _watch(self, storage: torch.UntypedStorage, key: int) -> None:
        self.finalizers.append(weakref.finalize(storage, self._died, key))

    def _died(self, key: int) -> None:
        mem = self.memory.pop(key, None)
        if mem is not None:
            self._retire(mem)

    def _retire(self, mem: Memory) -> None:
        """``mem`` went back to its pool: a later allocation there may reuse it; with
        ``give_back`` the device may take it at once ([Note: memory given back to the device])."""
        if self.give_back:
            owner = self.streams[mem.pool]
            for a in (a for a in (mem.write, *mem.reads) if a is not None):
                if a[0] != owner.name and not owner.after(a):
                    self.races.append(
                        f"{mem.pool}-pool memory given back while {a[0]}@{a[1]} may use it"
                    )
        freed = self.freed.setdefault(mem.pool, {})
        for name, tick in (a for a in (mem.write, *mem.reads) if a is not None):
            freed[name] = max(freed.get(name, 0), tick)

    def released(self, t: torch.Tensor) -> None:
        mem = self.memory.pop(self._key(t), None)
        if mem is not None:
            self._retire(mem)

    def access(self, t: torch.Tensor, *, write: bool, what: str) -> None:
        if t.untyped_storage().nbytes() == 0:
            return
        stream = self.current()
        key = self._key(t)
        mem = self.memory.get(key)
        if mem is None:  # made before the simulation, on the compute stream
            mem = self.memory[key] = Memory(self.compute.name, {})
            self._watch(t.untyped_storage(), key)
        earlier = [
            *mem.prior.items(),
            *([mem.write] if mem.write else []),
            *(mem.reads if write else []),
        ]
        for a in earlier:
            if a[0] != stream.name and not stream.after(a):
                self.races.append(f"{what} on {stream.name} races {a[0]}@{a[1]}")
        self.accessed.add(stream.name)
        tick = stream.tick()
        if write:
            mem.write, mem.reads = tick, []
        else:
            mem.reads.append(tick)


_TLS = threading.local()  # one simulation per rank (the ranks of a threaded group are threads)


def current_simulation() -> StreamSimulation | None:
    """The calling rank's simulation (inside ``simulated_streams``), else None."""
    current: StreamSimulation | None = getattr(_TLS, "sim", None)
    return current


def _sim() -> StreamSimulation:
    current = current_simulation()
    if current is None:
        raise RuntimeError("no simulated_streams() is active on this thread")
    return current


class Tracker(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records every aten op's reads and writes on the current simulated stream."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if schema.returns and all(
            r.alias_info is not None and not r.alias_info.is_write for r in schema.returns
        ):
            return out  # a view: no data touched (an op returning nothing, _foreach_add_, writes)
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
        for arg, value in zip(schema.arguments, values, strict=False):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    _sim().access(t, write=written, what=f"{func} {arg.name}")
        for ret, t in zip(schema.returns, tree_leaves(out), strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                _sim().fresh(t)  # a new storage, from the current stream's pool
                if func not in _ALLOCATIONS:
                    _sim().access(t, write=True, what=f"{func} output")
        return out


def _collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _sim().access(inp, write=False, what=f"{fn.__name__} input")
        _sim().access(out, write=True, what=f"{fn.__name__} output")
        with _disable_current_modes():
            return fn(out, inp, *args, **kwargs)

    return recorded


def _in_place_collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        _sim().access(tensor, write=False, what=f"{fn.__name__} input")
        _sim().access(tensor, write=True, what=f"{fn.__name__} output")
        with _disable_current_modes():
            return fn(tensor, *args, **kwargs)

    return recorded


def install_simulated_streams(monkeypatch: Patcher) -> None:
    """Route dbuffer's streams, events, allocations and collectives to the calling rank's
    simulation (in the test's thread, before the ranks start)."""
    real_allocate, real_free = storage.allocate_storage, storage.free_storage

    def allocate(t: torch.Tensor) -> bool:
        grown = real_allocate(t)
        if grown:
            _sim().allocated(t)
        return grown

    def free(t: torch.Tensor) -> None:
        if t.untyped_storage().nbytes() != 0:
            _sim().released(t)
        real_free(t)

    def comm_stream_for(device: torch.device, kind: str = "all_gather") -> SimulatedStream:
        return _sim().comm_stream(device, kind)

    monkeypatch.setattr(streams, "comm_stream_for", comm_stream_for)
    monkeypatch.setattr(streams, "current_stream", lambda device: _sim().current())
    monkeypatch.setattr(torch, "Event", SimulatedEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: _sim().current())
    monkeypatch.setattr(storage, "allocate_storage", allocate)
    monkeypatch.setattr(storage, "free_storage", free)
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, _collective(getattr(dist, name)))
    monkeypatch.setattr(dist, "all_reduce", _in_place_collective(dist.all_reduce))


def simulated_event_now(*_: Any) -> SimulatedEvent:
    """An event on the rank's current simulated stream (the engine's ``_event_now``)."""
    event = SimulatedEvent()
    event.record(_sim().current())
    return event


@contextlib.contextmanager
def simulated_streams(*, give_back: bool = False) -> Iterator[StreamSimulation]:
    """This rank's simulation, with every aten op recorded, for the body."""
    _TLS.sim = StreamSimulation(give_back=give_back)
    try:
        with Tracker():  # type: ignore[no-untyped-call]
            yield _TLS.sim
    finally:
        for finalizer in _TLS.sim.finalizers:
            finalizer.detach()
        del _TLS.sim
