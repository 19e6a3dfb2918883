"""The accelerator stream protocol of dbuffer's collectives, checked on CPU with simulated streams.

No accelerator runs here, so the protocol of [Note: streams and frees without record_stream]
(collectives.py) is checked on a model of it: simulated streams with vector clocks (an op issued
under a stream ticks that stream's clock, ``Event.record`` snapshots the clock, ``wait_event``
merges it), a dispatch mode that records which storage every aten op reads and writes and on
which stream (the collectives, which run inside the process group, are recorded by a wrapper:
the output written, the input read), and the caching allocator's rule without
``record_stream``: memory allocated under a stream and freed by the host may be handed to that
stream's next allocation at once, so every access to it must happen after every access to
memory of that pool freed before. An access that conflicts with an earlier one on another stream
with no happens-before path is a race. Allocations are tracked where dbuffer makes and frees its
unsharded storages (``_allocate`` / ``_free``); temporaries freed by the garbage collector are
not (they are used on one stream only).

Each scenario runs once on the real protocol (no race) and once with one ordering removed, which
the model must report (the check is not vacuous).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from dbuffer import DBuffer, contiguous_layout
from dbuffer._private import buffer as buffer_module
from dbuffer._private import collectives
from ragged_dtensor.testing import run_threaded

Access = tuple[str, int]  # (stream name, its clock at the access)


class SimStream:
    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.name = sim, name
        self.clock: dict[str, int] = {name: 0}
        self.stream_id = id(self)

    def tick(self) -> Access:
        self.clock[self.name] += 1
        return (self.name, self.clock[self.name])

    def after(self, access: Access) -> bool:
        """Does this stream's next op happen after ``access``?"""
        return self.clock.get(access[0], 0) >= access[1]

    def wait_event(self, event: SimEvent) -> None:
        for name, tick in event.clock.items():
            self.clock[name] = max(self.clock.get(name, 0), tick)

    def __enter__(self) -> SimStream:
        self.sim.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.sim.stack.pop()


class SimEvent:
    def __init__(self, device: Any = None, **_: Any) -> None:
        self.device = device
        self.clock: dict[str, int] = {}

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or sim().current()
        self.clock = dict(stream.clock)


class Memory:
    """One allocation: where it came from, its last write and the reads since."""

    def __init__(self, pool: str, prior: list[Access]) -> None:
        self.pool = pool
        self.prior = prior  # accesses to freed memory of the same pool (possible reuse)
        self.write: Access | None = None
        self.reads: list[Access] = []


class Sim:
    def __init__(self) -> None:
        self.compute = SimStream(self, "compute")
        self.stack: list[SimStream] = [self.compute]
        self.comm: dict[str, SimStream] = {}
        self.memory: dict[int, Memory] = {}
        self.freed: dict[str, list[Access]] = {}
        self.races: list[str] = []
        self.accessed: set[str] = set()  # streams that touched memory
        self.last_free: dict[Any, dict[int, Any]] = {}  # collectives._LAST_FREE of this rank

    def current(self) -> SimStream:
        return self.stack[-1]

    def comm_stream(self, device: torch.device, kind: str = "all_gather") -> SimStream:
        if kind not in self.comm:
            self.comm[kind] = SimStream(self, kind)
        return self.comm[kind]

    def _key(self, t: torch.Tensor) -> int:
        return int(t.untyped_storage()._cdata)

    def allocated(self, t: torch.Tensor) -> None:
        pool = self.current().name
        self.memory[self._key(t)] = Memory(pool, list(self.freed.get(pool, [])))

    def released(self, t: torch.Tensor) -> None:
        mem = self.memory.pop(self._key(t), None)
        if mem is not None:
            done = [a for a in (mem.write, *mem.reads) if a is not None]
            self.freed.setdefault(mem.pool, []).extend(done)

    def access(self, t: torch.Tensor, *, write: bool, what: str) -> None:
        if t.untyped_storage().nbytes() == 0:
            return
        stream = self.current()
        mem = self.memory.setdefault(self._key(t), Memory(stream.name, []))
        earlier = [*mem.prior, *([mem.write] if mem.write else []), *(mem.reads if write else [])]
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


def sim() -> Sim:
    current: Sim = _TLS.sim
    return current


class _LastFreePerRank:
    """Stands in for ``collectives._LAST_FREE``: each rank's own events."""

    def get(self, key: Any, default: Any = None) -> Any:
        return sim().last_free.get(key, default)

    def setdefault(self, key: Any, default: Any) -> Any:
        return sim().last_free.setdefault(key, default)


class Tracker(TorchDispatchMode):
    """Records every aten op's reads and writes on the current simulated stream."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
            return out  # a view: no data touched
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args) :]]
        for arg, value in zip(schema.arguments, values, strict=False):
            written = arg.alias_info is not None and arg.alias_info.is_write
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor):
                    sim().access(t, write=written, what=f"{func} {arg.name}")
        for ret, t in zip(schema.returns, tree_leaves(out), strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                sim().access(t, write=True, what=f"{func} output")
        return out


def _collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sim().access(inp, write=False, what=f"{fn.__name__} input")
        sim().access(out, write=True, what=f"{fn.__name__} output")
        with _disable_current_modes():
            return fn(out, inp, *args, **kwargs)

    return recorded


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route dbuffer's streams, events, allocations and collectives to the calling rank's
    simulation (in the test's thread, before the ranks start)."""
    real_allocate, real_free = buffer_module._allocate, buffer_module._free

    def allocate(t: torch.Tensor) -> bool:
        grown = real_allocate(t)
        if grown:
            sim().allocated(t)
        return grown

    def free(t: torch.Tensor) -> None:
        if t.untyped_storage().nbytes() != 0:
            sim().released(t)
        real_free(t)

    def comm_stream_for(device: torch.device, kind: str = "all_gather") -> SimStream:
        return sim().comm_stream(device, kind)

    monkeypatch.setattr(collectives, "comm_stream_for", comm_stream_for)
    monkeypatch.setattr(collectives, "_current", lambda device: sim().current())
    monkeypatch.setattr(collectives, "_LAST_FREE", _LastFreePerRank())
    monkeypatch.setattr(torch, "Event", SimEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: sim().current())
    monkeypatch.setattr(buffer_module, "_allocate", allocate)
    monkeypatch.setattr(buffer_module, "_free", free)
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, _collective(getattr(dist, name)))


def event_now(*_: Any) -> SimEvent:
    """An event on the rank's current simulated stream (the engine's ``_event_now``)."""
    event = SimEvent()
    event.record(sim().current())
    return event


@contextlib.contextmanager
def simulated() -> Iterator[Sim]:
    """This rank's simulation, with every aten op recorded, for the body."""
    _TLS.sim = Sim()
    try:
        with Tracker():
            yield _TLS.sim
    finally:
        del _TLS.sim


def _buffer() -> DBuffer:
    mesh = init_device_mesh("cpu", (1,))
    shapes = [(5, 3), (7,), (2, 2)]
    layout = contiguous_layout([15, 7, 4], 1, align=4)
    return DBuffer(layout, shapes, mesh, check=False)


def _iteration(buf: DBuffer, *, mixed: bool, ready: bool, wait: bool = True) -> None:
    """An optimizer write of the shard, then (like a forward and a backward) twice: an
    all-gather, compute reading the views, a reshard. With ``ready``, every all-gather waits on
    one event recorded after the optimizer (the engine's inputs-ready event), which does not
    cover the compute after it: only the free events order the reuse of gathered memory."""
    dtype = torch.bfloat16 if mixed else None
    buf.shard.add_(1.0)  # the optimizer, on the compute stream
    event = None
    if ready:
        event = SimEvent()
        event.record(sim().compute)
    for _ in range(2):
        handle = buf.unshard(dtype=dtype, async_op=True, ready=event)  # type: ignore[arg-type]
        if wait:
            handle.wait()
        torch.stack([v.sum() for v in buf.full_views(dtype, allow_released=True)])  # compute
        buf.reshard()


def _scenario(rank: int, world: int, case: str) -> tuple[list[str], set[str]]:
    buf = _buffer()
    with simulated() as state:
        if case in ("gather", "gather-no-wait", "gather-no-free-event"):
            for mixed in (False, True, True):
                for ready in (True, False):
                    _iteration(buf, mixed=mixed, ready=ready, wait=case != "gather-no-wait")
        elif case in ("reduce", "reduce-no-wait"):
            grads = buf.new_like()
            for accumulate, rdtype in (
                (False, None),
                (True, torch.float64),
                (False, torch.float64),
            ):
                grads.alloc_unsharded()
                grads.unsharded.fill_(1.0)  # autograd writes the gradients (compute)
                handle = grads.reduce_scatter(
                    reduce_dtype=rdtype, accumulate=accumulate, async_op=True
                )
                if case == "reduce":
                    handle.wait()
                buf.shard.add_(grads.shard)  # the optimizer reads the reduced shard
                grads.wait()
        return list(state.races), set(state.accessed)


CASES = {
    "gather": False,
    "gather-no-wait": True,  # compute reads the gathered views without Handle.wait
    "gather-no-free-event": True,  # the all-gather stream reuses memory without note_free
    "reduce": False,
    "reduce-no-wait": True,  # the optimizer reads the shard the reduce-scatter writes
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_protocol_has_no_race(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "gather-no-free-event":
        monkeypatch.setattr(collectives, "note_free", lambda device: None)
        monkeypatch.setattr(buffer_module, "note_free", lambda device: None)
    install(monkeypatch)
    races, accessed = run_threaded(_scenario, 1, case, timeout=60)[0]
    comm = "all_gather" if case.startswith("gather") else "reduce_scatter"
    assert accessed == {"compute", comm}, accessed  # the work ran on the streams it should
    if CASES[case]:
        assert races, f"{case}: the model saw no race where one was planted"
    else:
        assert races == [], races
