"""Staging for an asynchronous save on streams ([Note: staging without a stall] in
``checkpoint_staging``), checked on CPU with dbuffer's simulated streams.

The device path is taken for CPU tensors by giving them a simulated copy stream
(``_copy_stream``) and running the stager thread's job inline (``_submit``), so every access is
recorded on its simulated stream. What must hold, and the hazard each test plants:

- the copy reads the tensors after their last write and the next optimizer step writes them
  after the copy read them, while the next forward (reads) does not wait for the copy; planted:
  no guard before the step, reported as a race;
- under an enclosing stream context the copy is ordered after that stream's writes; planted:
  the ready event taken on the default (compute) stream instead, reported;
- the events the step waits on are of the tensor's own device, recorded on its copy stream;
  planted: ``record()`` on the current stream (what a bare ``record()`` does, the current
  device's), reported. The simulation has one device, so that the event is made with the
  tensor's device is checked on the arguments;
- pinned buffers are allocated on the stager thread, not the caller's, and reused by the next
  save; the staged values are the values at staging.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import pytest
import torch
from torch import nn

from dbuffer.testing import (
    SimulatedEvent,
    current_simulation,
    install_simulated_streams,
    simulated_streams,
)
from fsdp_engine._private import checkpoint_staging as staging


def _inline(job: Callable[[], None]) -> Future[None]:
    future: Future[None] = Future()
    job()
    future.set_result(None)
    return future


@pytest.fixture
def simulated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    install_simulated_streams(monkeypatch)

    def copy_stream(device: torch.device) -> Any:
        sim = current_simulation()
        assert sim is not None
        return sim.stream(f"d2h:{device}")

    monkeypatch.setattr(staging, "_copy_stream", copy_stream)
    monkeypatch.setattr(staging, "_submit", _inline)
    yield
    staging._GUARDS.clear()


def _model() -> tuple[nn.Parameter, torch.Tensor, torch.optim.Optimizer]:
    torch.manual_seed(0)
    param = nn.Parameter(torch.randn(64))
    flat = torch.randn(96)  # a flat optimizer-like state: two views of one storage
    optimizer = torch.optim.SGD([param], lr=0.1, foreach=False)
    param.grad = torch.ones(64)
    return param, flat, optimizer


def _state(param: torch.Tensor, flat: torch.Tensor) -> dict[str, Any]:
    return {"w": param.detach(), "state": {"a": flat[:32], "b": flat[40:].view(8, 7)}, "step": 3}


def _stage_and_step(
    *, user_stream: bool = False, forward_checks: bool = True
) -> tuple[list[str], dict[str, Any], dict[str, torch.Tensor]]:
    param, flat, optimizer = _model()
    with simulated_streams() as sim:
        # the whole loop runs on ``writer``: the compute stream, or a user's stream entered
        # around it (then the staging sees that stream as the current one)
        writer = sim.stream("user") if user_stream else sim.compute
        with writer:
            with torch.no_grad():  # the last step's writes
                param.mul_(2)
                flat.add_(1)
            expected = {"w": param.detach().clone(), "flat": flat.clone()}
            staged = staging.stage_state_dict(_state(param, flat))
            copy = sim.stream("d2h:cpu")
            assert "d2h:cpu" in sim.accessed
            if forward_checks:
                _ = (param * 3).sum()  # the next forward reads: it does not wait for the copy
                assert writer.clock.get(copy.name, 0) == 0
            optimizer.step()  # the next step writes the parameter: after the copy read it
            with torch.no_grad():
                flat.mul_(0.5)  # and the optimizer state, on the same stream after the step
        races = list(sim.races)
        if not races:
            assert writer.clock.get(copy.name, 0) >= copy.clock[copy.name]
    return races, staged.state_dict, expected


def test_copy_on_its_stream_and_only_the_step_waits(simulated: None) -> None:
    races, state, expected = _stage_and_step()
    assert races == []
    assert torch.equal(state["w"], expected["w"])
    assert torch.equal(state["state"]["a"], expected["flat"][:32])
    assert torch.equal(state["state"]["b"], expected["flat"][40:].view(8, 7))
    assert state["step"] == 3


def test_planted_no_guard_before_the_step_is_reported(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(staging._DeviceCopies, "guard", lambda self: None)
    races, _, _ = _stage_and_step()
    assert any("on compute races d2h:cpu" in race for race in races), races


def test_enclosing_stream_context(simulated: None) -> None:
    races, state, expected = _stage_and_step(user_stream=True)
    assert races == []
    assert torch.equal(state["w"], expected["w"])


def test_planted_ready_event_on_the_default_stream_is_reported(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    def default_stream(device: Any = None) -> Any:
        sim = current_simulation()
        assert sim is not None
        return sim.compute

    monkeypatch.setattr(torch.accelerator, "current_stream", default_stream)
    races, _, _ = _stage_and_step(user_stream=True, forward_checks=False)
    assert any("on d2h:cpu races user" in race for race in races), races


def test_events_of_the_tensors_device_on_its_copy_stream(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[Any] = []

    class Recorded(SimulatedEvent):
        def __init__(self, device: Any = None, **kwargs: Any) -> None:
            made.append(device)
            super().__init__(device, **kwargs)

    monkeypatch.setattr(torch, "Event", Recorded)
    races, _, _ = _stage_and_step()
    assert races == []
    assert made and all(device == torch.device("cpu") for device in made), made


def test_planted_done_event_on_the_current_stream_is_reported(
    simulated: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    record = SimulatedEvent.record
    # a bare ``record()``: the current stream (of the current device), not the copy stream
    monkeypatch.setattr(SimulatedEvent, "record", lambda self, stream=None: record(self, None))
    races, _, _ = _stage_and_step()
    assert any("on compute races d2h:cpu" in race for race in races), races


class _Stream:
    def wait_event(self, event: Any) -> None:
        pass

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _Event:
    def __init__(self, device: Any = None, **_: Any) -> None:
        self.device = device

    def record(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_buffers_allocated_off_the_calling_thread_and_reused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(staging, "_copy_stream", lambda device: _Stream())
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(torch.accelerator, "current_stream", lambda device=None: _Stream())
    takes: list[tuple[str, int]] = []
    take = staging._PinnedPool.take

    def recorded(self: Any, nbytes: int, pinned: bool) -> torch.Tensor:
        buffer = take(self, nbytes, pinned)
        takes.append((threading.current_thread().name, buffer.data_ptr()))
        return buffer

    monkeypatch.setattr(staging._PinnedPool, "take", recorded)
    param, flat, _ = _model()
    try:
        staged = [staging.stage_state_dict(_state(param, flat)) for _ in range(1)]
        staged[0].wait()
        assert torch.equal(staged[0].state_dict["w"], param.detach())
        staged[0].release()
        first = [ptr for _, ptr in takes]
        with torch.no_grad():
            param.add_(1)
        again = staging.stage_state_dict(_state(param, flat))
        again.wait()
        assert torch.equal(again.state_dict["w"], param.detach())
        assert torch.equal(again.state_dict["state"]["a"], flat[:32])
        assert [ptr for _, ptr in takes[len(first) :]] == first  # the same buffers
        assert all(name.startswith("fsdp_engine-stager") for name, _ in takes), takes
        again.release()
    finally:
        staging._GUARDS.clear()
