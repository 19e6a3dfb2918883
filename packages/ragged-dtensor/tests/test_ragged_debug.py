"""The collective debug mode (``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1`` when the DTensor integration is
installed, or ``with collective_checks():``): off by default (no mode, no collective added), never
entered at import; on, every rank raises ``CollectiveMismatchError`` naming the group, each side's
operation and the ranks elsewhere, within 30 s, before a mismatched collective runs; the
collectives themselves (and their autograd) are unchanged."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import _get_current_dispatch_mode

import ragged_dtensor
from ragged_dtensor import CollectiveMismatchError, RaggedShard, distribute_tensor
from ragged_dtensor.testing import count_collectives, run_processes

DEADLINE_S = 30.0


def test_off_by_default() -> None:
    assert not ragged_dtensor.collective_checks_enabled()
    assert _get_current_dispatch_mode() is None


_ENTRY_SCRIPT = """
import ragged_dtensor
from torch.utils._python_dispatch import _len_torch_dispatch_stack
assert _len_torch_dispatch_stack() == 0 and not ragged_dtensor.collective_checks_enabled()
print("imported: no mode")
ragged_dtensor.RaggedShard((0,), (1, 1))  # installs the integration: the checks are entered
assert _len_torch_dispatch_stack() == 1 and ragged_dtensor.collective_checks_enabled()
print("installed: checks on")
ragged_dtensor.uninstall_dtensor_integration()
assert _len_torch_dispatch_stack() == 0 and not ragged_dtensor.collective_checks_enabled()
print("removed: checks off")
"""


def _run_entry(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _ENTRY_SCRIPT],
        capture_output=True,
        text=True,
        env={**_environ(), **env},
        check=False,
        timeout=120,
    )


def test_the_environment_enters_the_checks_with_the_integration_not_at_import() -> None:
    done = _run_entry({"RAGGED_DTENSOR_DEBUG_COLLECTIVES": "1"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == [
        "imported: no mode",
        "installed: checks on",
        "removed: checks off",
    ]


_CORNERS_SCRIPT = """
import os, threading, warnings
import ragged_dtensor
from torch.utils._python_dispatch import TorchDispatchMode, _len_torch_dispatch_stack

class Other(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with Other():  # installed under another mode: entering would break that mode's exit
        ragged_dtensor.RaggedShard((0,), (1, 1))
        assert _len_torch_dispatch_stack() == 1
assert _len_torch_dispatch_stack() == 0 and not ragged_dtensor.collective_checks_enabled()
print("under another mode:", [str(w.message) for w in caught if "not entered" in str(w.message)])
ragged_dtensor.uninstall_dtensor_integration()

thread = threading.Thread(target=lambda: ragged_dtensor.RaggedShard((0,), (1, 1)))
thread.start(); thread.join()  # installed (and the checks entered) on a thread that has ended
assert ragged_dtensor.collective_checks_enabled()
ragged_dtensor.uninstall_dtensor_integration()
assert _len_torch_dispatch_stack() == 0 and not ragged_dtensor.collective_checks_enabled()
print("thread ended: removed", flush=True)
# the checks above are the test; the interpreter's teardown is not: once, on a loaded CI machine,
# it aborted after the last line ("terminate called without an active exception", a C++ thread
# of torch's destroyed while joinable), which this script's behaviour does not decide
os._exit(0)
"""


def test_the_environment_never_breaks_another_mode_or_pins_an_ended_thread() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CORNERS_SCRIPT],
        capture_output=True,
        text=True,
        env={**_environ(), "RAGGED_DTENSOR_DEBUG_COLLECTIVES": "1"},
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.strip().split("\n")[-2:]
    assert "the collective checks were not entered" in first and "Other" in first, first
    assert "use `with ragged_dtensor.collective_checks():`" in first, first
    assert second == "thread ended: removed"


def test_a_bad_timeout_is_named_when_the_integration_is_installed() -> None:
    env = {"RAGGED_DTENSOR_DEBUG_COLLECTIVES": "1", "RAGGED_DTENSOR_DEBUG_TIMEOUT": "soon"}
    done = _run_entry(env)
    assert done.returncode != 0
    assert done.stdout.startswith("imported: no mode")  # import itself never reads it
    assert "RAGGED_DTENSOR_DEBUG_TIMEOUT='soon': expected a number of seconds" in done.stderr
    assert not ragged_dtensor.collective_checks_enabled()


def test_collective_checks_block_enters_and_leaves_the_mode() -> None:
    assert _get_current_dispatch_mode() is None
    with ragged_dtensor.collective_checks(timeout=5.0):
        mode = _get_current_dispatch_mode()
        assert mode is not None and ragged_dtensor.collective_checks_enabled()
        with ragged_dtensor.collective_checks():  # nested: the checks in force
            assert _get_current_dispatch_mode() is mode
        assert _get_current_dispatch_mode() is mode
    assert _get_current_dispatch_mode() is None
    assert not ragged_dtensor.collective_checks_enabled()
    with (
        pytest.raises(ValueError, match=r"collective_checks\(timeout=0\): expected a positive"),
        ragged_dtensor.collective_checks(timeout=0),
    ):
        pass


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)


# -- on real gloo processes ------------------------------------------------------------------------


def _agreeing_work(rank: int, world: int) -> dict[str, object]:
    """DTensor redistributions (functional collectives, some inside DTensor's dispatch), plain
    collectives, an object collective, autograd through a functional collective, and a
    collective under inference_mode: the same results with and without the checks."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    with count_collectives() as counter:
        ragged = distribute_tensor(full, mesh, [RaggedShard((0,), (1, 2))])
        gathered = ragged.full_tensor()
        norm = distribute_tensor(full, mesh, [Shard(0)]).norm().full_tensor()
        total = torch.ones(3) * (rank + 1)
        dist.all_reduce(total)
        names: list[object] = [None] * world
        dist.all_gather_object(names, f"rank{rank}")
    x = torch.full((2,), float(rank + 1), requires_grad=True)
    y = funcol.wait_tensor(funcol.all_reduce(x, "sum", dist.group.WORLD))
    (y * torch.tensor([1.0, 2.0])).sum().backward()  # d/dx: all_reduce of the upstream grad
    with torch.inference_mode():
        late = torch.ones(1)
        dist.all_reduce(late)
    assert x.grad is not None
    return {
        "gathered": torch.equal(gathered, full),
        "norm": float(norm),
        "total": total.tolist(),
        "names": names,
        "grad": x.grad.tolist(),
        "late": late.item(),
        "calls": dict(counter.calls),
        "checks": ragged_dtensor.collective_checks_enabled(),
    }


def _mismatch(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        x.full_tensor()  # a functional all-gather


def _elsewhere(rank: int, world: int) -> None:
    other = dist.new_group(list(range(world)))
    if rank == 0:
        dist.all_reduce(torch.ones(3))
    else:
        dist.barrier(group=other)  # waits on another group for rank 0, which never comes


def _cases(
    rank: int, world: int, names: list[str], explicit: bool = False
) -> dict[str, tuple[str, float, object]]:
    """Each case on a fresh process group of the same store (one spawn for all of them).

    With the environment variable set, installing the integration enters the checks (the
    mismatch cases use no RaggedShard, so it is installed here); ``explicit``: each case runs
    in ``with collective_checks():`` instead."""
    if not explicit:
        ragged_dtensor.install_dtensor_integration()
    store = dist.distributed_c10d._get_default_store()
    bodies: dict[str, Callable[[int, int], object]] = {
        "agree": _agreeing_work,
        "mismatch": _mismatch,
        "elsewhere": _elsewhere,
    }
    outcomes = {}
    for index, name in enumerate(names):
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"case-{index}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        start = time.monotonic()
        value: object = None
        try:
            with ragged_dtensor.collective_checks() if explicit else contextlib.nullcontext():
                value = bodies[name](rank, world)
            outcome = "no error"
        except CollectiveMismatchError as exc:
            outcome = f"CollectiveMismatchError: {exc}"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        outcomes[name] = (outcome, time.monotonic() - start, value)
    return outcomes


@pytest.fixture(scope="module")
def debug_runs() -> dict[str, list[dict[str, tuple[str, float, object]]]]:
    """The cases on 2 gloo processes, with the checks on (default timeout) and off."""
    import os

    runs = {}
    for mode in ("on", "off", "explicit"):
        names = {
            "on": ["agree", "mismatch", "elsewhere"],
            "off": ["agree"],
            "explicit": ["mismatch"],
        }[mode]
        saved = os.environ.pop("RAGGED_DTENSOR_DEBUG_COLLECTIVES", None)
        os.environ.pop("RAGGED_DTENSOR_DEBUG_TIMEOUT", None)
        if mode == "on":
            os.environ["RAGGED_DTENSOR_DEBUG_COLLECTIVES"] = "1"  # spawned ranks inherit it
        try:
            runs[mode] = run_processes(_cases, 2, names, mode == "explicit", timeout=240)
        finally:
            os.environ.pop("RAGGED_DTENSOR_DEBUG_COLLECTIVES", None)
            if saved is not None:
                os.environ["RAGGED_DTENSOR_DEBUG_COLLECTIVES"] = saved
    return runs


@pytest.mark.multiprocess
def test_checks_change_nothing_when_the_ranks_agree(debug_runs: dict[str, list]) -> None:  # type: ignore[type-arg]
    for rank in range(2):
        on = debug_runs["on"][rank]["agree"]
        off = debug_runs["off"][rank]["agree"]
        assert on[0] == "no error" and off[0] == "no error", (on, off)
        on_values, off_values = dict(on[2]), dict(off[2])  # type: ignore[call-overload]
        assert on_values.pop("checks") is True and off_values.pop("checks") is False
        assert on_values == off_values  # same values, same gradient, same collectives
        assert on_values["grad"] == [2.0, 4.0] and on_values["late"] == 2.0


@pytest.mark.multiprocess
@pytest.mark.parametrize("how", ["on", "explicit"])
def test_different_collectives_name_both_sides_on_every_rank(
    debug_runs: dict[str, list],  # type: ignore[type-arg]
    how: str,
) -> None:
    messages = {debug_runs[how][rank]["mismatch"][0] for rank in range(2)}
    assert len(messages) == 1, messages  # the same verdict, worded the same, on both ranks
    message = messages.pop()
    assert message.startswith("CollectiveMismatchError: collective mismatch on process group")
    assert "(global ranks [0, 1], gloo)" in message
    assert "ranks [0] are at all_reduce((3,) float32) at step 0" in message, message
    assert "ranks [1] are at all_gather_into_tensor((4,) float32) at step 0" in message, message
    assert "test_ragged_debug.py" in message  # the caller
    for rank in range(2):
        assert debug_runs[how][rank]["mismatch"][1] < DEADLINE_S


@pytest.mark.multiprocess
def test_a_rank_elsewhere_is_named_after_the_timeout(
    debug_runs: dict[str, list],  # type: ignore[type-arg]
) -> None:
    waited_0, seconds_0, _ = debug_runs["on"][0]["elsewhere"]
    waited_1, seconds_1, _ = debug_runs["on"][1]["elsewhere"]
    assert "collective timeout on process group '0'" in waited_0, waited_0
    assert "ranks [0] waited 10 s at all_reduce((3,) float32)" in waited_0, waited_0
    assert "for ranks [1], which are elsewhere" in waited_0
    assert "rank 1: last entered barrier on group '1'" in waited_0, waited_0
    assert "collective timeout on process group '1'" in waited_1, waited_1
    assert "rank 0: last entered all_reduce on group '0'" in waited_1, waited_1
    assert seconds_0 < DEADLINE_S and seconds_1 < DEADLINE_S
