"""The accelerator stream protocol of dbuffer's collectives, checked on CPU with simulated streams.

The model (``dbuffer.testing.simulated_streams``: vector clocks per stream, the reads and writes
of every aten op and collective, the caching allocator's per-stream pools, memory given back to
the device) is described in ``dbuffer/_private/simulated_streams.py``.

Each scenario runs once on the real protocol (no race) and once with one ordering removed, which
the model must report (the check is not vacuous).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer._private import streams
from dbuffer.testing import (
    SimulatedEvent,
    StreamSimulation,
    current_simulation,
    install_simulated_streams,
    simulated_streams,
)
from ragged_dtensor.testing import run_threaded

_TLS = threading.local()  # each rank's log of hooks and collectives (ranks are threads)


def sim() -> StreamSimulation:
    """The calling rank's simulation."""
    current = current_simulation()
    assert current is not None
    return current


def plant_deferred_hand_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """The old protocol: a free records the caller's event and the owning stream waits on it
    only at its next all-gather (enough for reuse by the same stream, not for memory given
    back to the device)."""
    pending: dict[int, list[SimulatedEvent]] = {}

    def deferred(owner: Any, device: torch.device) -> None:
        if owner is None or owner is sim().current():
            return
        event = SimulatedEvent()
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
        event = SimulatedEvent()
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
    with simulated_streams(give_back=give_back) as state:
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
    install_simulated_streams(monkeypatch)
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
    install_simulated_streams(monkeypatch)
    races, _ = run_threaded(_scenario, 1, "gather-deferred", True, timeout=60)[0]
    assert any("given back" in race for race in races), races


def _pools(case: str) -> list[str]:
    """A temporary of the compute stream's pool read on the all-gather stream, freed by the
    host, then a new allocation on ``"compute"`` (may reuse it: a race unless the compute stream
    waited for the read), ``"compute-after-event"`` (it did) or ``"all_gather"`` (another
    stream's pool never reuses it: no race)."""
    with simulated_streams() as state:
        side = state.comm_stream(torch.device("cpu"))
        temporary = torch.ones(64)  # the compute stream's pool
        written = SimulatedEvent()
        written.record(state.compute)
        side.wait_event(written)
        with side:
            temporary.sum()  # read on the all-gather stream
            read = SimulatedEvent()
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
        current_sim = current_simulation()
        return current_sim.current().name if current_sim is not None else None

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
    with simulated_streams() if simulate else contextlib.nullcontext():
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
        install_simulated_streams(monkeypatch)
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
