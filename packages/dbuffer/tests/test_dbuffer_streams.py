"""The accelerator stream protocol of dbuffer's collectives, checked on CPU with simulated streams.

No accelerator runs here, so the protocol of [Note: streams and frees without record_stream]
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

Each scenario runs once on the real protocol (no race) and once with one ordering removed, which
the model must report (the check is not vacuous).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

from dbuffer import DBuffer, contiguous_layout
from dbuffer._private import storage, streams
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


class Sim:
    def __init__(self, *, give_back: bool = False) -> None:
        self.compute = SimStream(self, "compute")
        self.stack: list[SimStream] = [self.compute]
        self.comm: dict[str, SimStream] = {}
        self.streams: dict[str, SimStream] = {"compute": self.compute}
        self.give_back = give_back
        self.memory: dict[int, Memory] = {}
        self.freed: dict[str, dict[str, int]] = {}  # pool -> stream -> last access to freed memory
        self.races: list[str] = []
        self.accessed: set[str] = set()  # streams that touched memory
        self.finalizers: list[weakref.finalize[Any, Any]] = []

    def current(self) -> SimStream:
        return self.stack[-1]

    def comm_stream(self, device: torch.device, kind: str = "all_gather") -> SimStream:
        if kind not in self.comm:
            self.comm[kind] = self.stream(kind)
        return self.comm[kind]

    def stream(self, name: str) -> SimStream:
        """A stream of its own (a user's side stream, or a communication stream)."""
        if name not in self.streams:
            self.streams[name] = SimStream(self, name)
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


def sim() -> Sim:
    current: Sim = _TLS.sim
    return current


class Tracker(TorchDispatchMode):
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
                    sim().access(t, write=written, what=f"{func} {arg.name}")
        for ret, t in zip(schema.returns, tree_leaves(out), strict=False):
            if isinstance(t, torch.Tensor) and ret.alias_info is None:
                sim().fresh(t)  # a new storage, from the current stream's pool
                if func not in _ALLOCATIONS:
                    sim().access(t, write=True, what=f"{func} output")
        return out


def _collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(out: torch.Tensor, inp: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sim().access(inp, write=False, what=f"{fn.__name__} input")
        sim().access(out, write=True, what=f"{fn.__name__} output")
        with _disable_current_modes():
            return fn(out, inp, *args, **kwargs)

    return recorded


def _in_place_collective(fn: Callable[..., Any]) -> Callable[..., Any]:
    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sim().access(tensor, write=False, what=f"{fn.__name__} input")
        sim().access(tensor, write=True, what=f"{fn.__name__} output")
        with _disable_current_modes():
            return fn(tensor, *args, **kwargs)

    return recorded


def install(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route dbuffer's streams, events, allocations and collectives to the calling rank's
    simulation (in the test's thread, before the ranks start)."""
    real_allocate, real_free = storage.allocate_storage, storage.free_storage

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

    monkeypatch.setattr(streams, "comm_stream_for", comm_stream_for)
    monkeypatch.setattr(streams, "current_stream", lambda device: sim().current())
    monkeypatch.setattr(torch, "Event", SimEvent)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: sim().current())
    monkeypatch.setattr(storage, "allocate_storage", allocate)
    monkeypatch.setattr(storage, "free_storage", free)
    for name in ("all_gather_single", "reduce_scatter_single"):
        monkeypatch.setattr(dist, name, _collective(getattr(dist, name)))
    monkeypatch.setattr(dist, "all_reduce", _in_place_collective(dist.all_reduce))


def plant_deferred_hand_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old protocol: a free records the caller's event and the owning stream waits on it
    only at its next all-gather (enough for reuse by the same stream, not for memory given
    back to the device)."""
    pending: dict[int, list[SimEvent]] = {}

    def deferred(owner: Any, device: torch.device) -> None:
        if owner is None or owner is sim().current():
            return
        event = SimEvent()
        event.record(sim().current())
        pending.setdefault(id(sim()), []).append(event)

    real_ordered = streams.ordered_after

    def ordered_after(stream: Any, device: torch.device, ready: Any) -> None:
        real_ordered(stream, device, ready)
        if stream is not None:
            for event in pending.pop(id(sim()), []):
                stream.wait_event(event)

    monkeypatch.setattr(streams, "hand_back", deferred)
    monkeypatch.setattr(streams, "ordered_after", ordered_after)


def event_now(*_: Any) -> SimEvent:
    """An event on the rank's current simulated stream (the engine's ``_event_now``)."""
    event = SimEvent()
    event.record(sim().current())
    return event


@contextlib.contextmanager
def simulated(*, give_back: bool = False) -> Iterator[Sim]:
    """This rank's simulation, with every aten op recorded, for the body."""
    _TLS.sim = Sim(give_back=give_back)
    try:
        with Tracker():
            yield _TLS.sim
    finally:
        for finalizer in _TLS.sim.finalizers:
            finalizer.detach()
        del _TLS.sim


def _buffer(mesh_shape: tuple[int, ...] = (1,)) -> DBuffer:
    names = ("replicate", "shard") if len(mesh_shape) == 2 else None
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    shapes = [(5, 3), (7,), (2, 2)]
    layout = contiguous_layout([15, 7, 4], mesh_shape[-1], align=4)
    return DBuffer(layout, shapes, mesh, check=False)


def _iteration(buf: DBuffer, *, mixed: bool, ready: bool, wait: bool = True) -> None:
    """An optimizer write of the shard, then (like a forward and a backward) twice: an
    all-gather, compute reading the views, a reshard. With ``ready``, every all-gather waits on
    one event recorded after the optimizer (the engine's inputs-ready event), which does not
    cover the compute after it: only the frees order the reuse of gathered memory."""
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


def _gather(buf: DBuffer, case: str) -> None:
    for mixed in (False, True, True):
        for ready in (True, False):
            _iteration(buf, mixed=mixed, ready=ready, wait=case != "gather-no-wait")


def _reduce(buf: DBuffer, case: str) -> None:
    grads = buf.new_like()
    hook_stream = sim().stream("user") if case.startswith("reduce-hook") else None
    seen: list[float] = []

    def hook(reduced: torch.Tensor) -> None:  # a user all-reduce hook: reads and scales
        reduced.mul_(0.5)

    for accumulate, rdtype in ((False, None), (True, torch.float64), (False, torch.float64)):
        grads.alloc_unsharded()
        grads.unsharded.fill_(1.0)  # autograd writes the gradients (compute)
        handle = grads.reduce_scatter(
            op="avg",
            reduce_dtype=rdtype,
            accumulate=accumulate,
            async_op=True,
            hook=hook if hook_stream is not None else None,
            hook_stream=hook_stream,  # type: ignore[arg-type]
        )
        if case != "reduce-no-wait":
            handle.wait()
        buf.shard.add_(grads.shard)  # the optimizer reads the reduced shard
        grads.wait()
        seen.append(float(grads.shard[0]))


def _scenario(rank: int, world: int, case: str, give_back: bool) -> tuple[list[str], set[str]]:
    buf = _buffer((world, 1) if case.startswith("reduce-hook") else (1,))
    with simulated(give_back=give_back) as state:
        if case.startswith("gather"):
            _gather(buf, case)
        else:
            _reduce(buf, case)
        return list(state.races), set(state.accessed)


GATHER, REDUCE = {"compute", "all_gather"}, {"compute", "reduce_scatter"}
HOOKED = {"compute", "reduce_scatter", "all_reduce", "user"}
# case -> (a race is planted: when blocks are only reused / when they may be given back, the
# streams that must have run work)
CASES: dict[str, tuple[bool, bool, set[str]]] = {
    "gather": (False, False, GATHER),
    # compute reads the gathered views without Handle.wait
    "gather-no-wait": (True, True, GATHER),
    # frees without the all-gather stream waiting for compute's reads
    "gather-no-hand-back": (True, True, GATHER),
    # the old protocol (the wait deferred to the next all-gather): fine for reuse only
    "gather-deferred": (False, True, GATHER),
    "reduce": (False, False, REDUCE),
    # the optimizer reads the shard the reduce-scatter writes
    "reduce-no-wait": (True, True, REDUCE),
    # HSDP (2 replicas of 1 shard rank: no reduce-scatter, FSDP2's skip) with a user hook on
    # its own stream: the all-reduce on its stream, the hook after it
    "reduce-hook": (False, False, HOOKED),
    # the hook's stream does not wait for the reduction (defect 1 of issue 24)
    "reduce-hook-unordered": (True, True, HOOKED),
}


def _plant(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if case == "gather-no-hand-back":
        monkeypatch.setattr(streams, "hand_back", lambda owner, device: None)
    elif case.startswith("gather-deferred"):
        plant_deferred_hand_back(monkeypatch)
    elif case == "reduce-hook-unordered":
        from dbuffer._private import collectives

        real = collectives._follow

        def follow(previous: Any, stream: Any, device: torch.device) -> Any:
            if stream is not None and stream.name == "user":
                return stream  # no wait on the stream before it
            return real(previous, stream, device)

        monkeypatch.setattr(collectives, "_follow", follow)


@pytest.mark.parametrize("give_back", [False, True], ids=["reuse", "give-back"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_stream_protocol_has_no_race(
    case: str, give_back: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(case, monkeypatch)
    install(monkeypatch)
    world = 2 if case.startswith("reduce-hook") else 1
    for races, accessed in run_threaded(_scenario, world, case, give_back, timeout=60):
        planted_reuse, planted_give_back, streams_used = CASES[case]
        planted = planted_give_back if give_back else planted_reuse
        assert accessed == streams_used, accessed  # the work ran on the streams it should
        if planted:
            assert races, f"{case}: the model saw no race where one was planted"
        else:
            assert races == [], races


def test_deferred_frees_race_only_when_memory_is_given_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24, defect 2: the old protocol (reshard records an event, the all-gather stream
    waits on it at the next all-gather) is safe while freed blocks are only reused by their own
    stream, and a race once the allocator may give a block back to the device, which FSDP2's
    rule (and ours now: the owner waits before the free) rules out."""
    plant_deferred_hand_back(monkeypatch)
    install(monkeypatch)
    races, _ = run_threaded(_scenario, 1, "gather-deferred", True, timeout=60)[0]
    assert any("given back" in race for race in races), races


def _pools(case: str) -> list[str]:
    """A temporary of the compute stream's pool read on the all-gather stream, freed by the
    host, then a new allocation on ``"compute"`` (may reuse it: a race unless the compute stream
    waited for the read), ``"compute-after-event"`` (it did) or ``"all_gather"`` (another
    stream's pool never reuses it: no race)."""
    with simulated() as state:
        side = state.comm_stream(torch.device("cpu"))
        temporary = torch.ones(64)  # the compute stream's pool
        written = SimEvent()
        written.record(state.compute)
        side.wait_event(written)
        with side:
            temporary.sum()  # read on the all-gather stream
            read = SimEvent()
            read.record(side)
        if case == "compute-after-event":
            state.compute.wait_event(read)
        del temporary  # the host frees it: its block goes back to the compute stream's pool
        with side if case == "all_gather" else contextlib.nullcontext():
            torch.zeros(64)  # a new allocation of the current stream, written at once
        return list(state.races)


@pytest.mark.parametrize(
    ("case", "race"), [("compute", True), ("compute-after-event", False), ("all_gather", False)]
)
def test_allocator_pools_are_per_stream(case: str, race: bool) -> None:
    """[Note: the caching allocator's per-stream pools]: the model reports reuse within a pool
    without ordering, and only that."""
    races = _pools(case)
    assert bool(races) == race, races


# -- the before_collective hook (race checks on a device: a sleep kernel before each collective)

_KINDS = {
    "all_gather_single": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "all_reduce": "all_reduce",
}


def _log_hook_and_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Append every ``before_collective`` call and every collective issued, in order, to the
    calling rank's ``_TLS.log`` (stream names: the simulation's, or None without streams)."""

    def name(stream: Any) -> str | None:
        return None if stream is None else str(stream.name)

    def current() -> str | None:
        return sim().current().name if getattr(_TLS, "sim", None) is not None else None

    def hook(kind: str, stream: Any) -> None:
        _TLS.log.append(("hook", kind, name(stream), name(stream) == current()))

    monkeypatch.setattr(streams, "before_collective", hook)

    def logged(real: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def issued(*args: Any, **kwargs: Any) -> Any:
            _TLS.log.append(("issued", kind, current()))
            return real(*args, **kwargs)

        return issued

    for fn, kind in _KINDS.items():
        monkeypatch.setattr(dist, fn, logged(getattr(dist, fn), kind))


def _packed_gather(buf: DBuffer) -> None:
    from dbuffer import PackedAllGather, packed_layout

    layout = packed_layout([[4 * buf.shard_size]] * buf.world_size)
    gather = PackedAllGather(buf, layout, check=False)

    def encode(send: torch.Tensor) -> None:
        send.view(torch.float32)[: buf.shard_size].copy_(buf.shard)

    def decode(recv: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(recv.view(torch.float32)[: out.numel()])

    gather.unshard(encode, decode, dtype=torch.float32).wait()
    buf.reshard()


def _hooked(rank: int, world: int, case: str, simulate: bool) -> list[tuple[Any, ...]]:
    buf = _buffer((world, 1) if case == "hsdp" else (world,))
    _TLS.log = []
    with simulated() if simulate else contextlib.nullcontext():
        if case == "packed":
            _packed_gather(buf)
        elif simulate:
            _gather(buf, "gather")
            _reduce(buf, "reduce-hook" if case == "hsdp" else "reduce")
        else:
            buf.unshard()
            buf.reshard()
            grads = buf.new_like()
            grads.alloc_unsharded()
            grads.unsharded.fill_(1.0)
            grads.reduce_scatter(op="avg")
            grads.wait()
    log: list[tuple[Any, ...]] = _TLS.log
    del _TLS.log
    return log


@pytest.mark.parametrize(
    ("case", "simulate", "kinds"),
    [
        ("sharded", True, {"all_gather", "reduce_scatter"}),
        # 2 replicas of 1 shard rank: no reduce-scatter (one rank copies), the all-reduce
        ("hsdp", True, {"all_gather", "all_reduce"}),
        ("packed", True, {"all_gather"}),
        ("sharded", False, {"all_gather", "reduce_scatter"}),  # CPU: no streams
    ],
)
def test_before_collective_runs_once_per_collective_on_its_stream(
    case: str, simulate: bool, kinds: set[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``streams.before_collective`` (default None) is called once right before each collective
    dbuffer issues, with its kind and its communication stream, then the current stream (the
    simulated streams stand in for a device's); None where there are no streams (gloo)."""
    assert streams.before_collective is None  # opt-in
    if simulate:
        install(monkeypatch)
    _log_hook_and_collectives(monkeypatch)
    for log in run_threaded(_hooked, 2, case, simulate, timeout=60):
        hooks, issued = log[0::2], log[1::2]
        assert len(hooks) == len(issued) > 0, log
        assert {h[1] for h in hooks} == kinds, log
        for hook, collective in zip(hooks, issued, strict=True):
            assert hook[0] == "hook" and collective[0] == "issued", log
            assert hook[1] == collective[1], log  # the kind of the collective that follows
            if simulate:  # its own communication stream, current, and the collective's
                assert hook[2:] == (hook[1], True) and collective[2] == hook[1], log
            else:
                assert hook[2] is None and collective[2] is None, log
