"""Run one function on N ranks: real gloo processes, or threads of one process for breadth.

Every package of the monorepo reuses these in its tests.

- ``run_processes(fn, world_size)``: spawned processes, a real ``gloo`` process group each, a hard
  timeout so a hang fails the test instead of CI; a failure on any rank is re-raised with that
  rank's traceback.
- ``run_threaded(fn, world_size)``: torch's threaded process group (real collectives between threads
  of this process). Starts in milliseconds; use it for property tests over many shapes and meshes.

``fn(rank, world_size, *args)`` must be a module-level function (it is pickled for processes).

Pitfall of threads: they share torch's global random generator, so ``torch.manual_seed(0)`` followed
by ``torch.randn`` in each thread interleaves and gives every rank *different* data. Use a local
``torch.Generator().manual_seed(0)`` (``torch.randn(..., generator=gen)``) in threaded bodies.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ragged_dtensor._private.processes import DistributedFailure, free_port, run_processes

__all__ = [
    "expect_error_on_every_rank",
    "run_readme_example",
    "CollectiveCounter",
    "DistributedFailure",
    "count_collectives",
    "free_port",
    "run_processes",
    "run_threaded",
]

T = TypeVar("T")


def run_threaded(
    fn: Callable[..., T], world_size: int, *args: Any, timeout: float = 60.0
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` threads sharing a threaded PG."""
    import importlib

    # torch's threaded process group lives in its (untyped) internal testing package
    mtpg: Any = importlib.import_module("torch.testing._internal.distributed.multi_threaded_pg")
    c10d: Any = torch._C._distributed_c10d
    world = mtpg._install_threaded_pg()
    store = dist.HashStore()  # type: ignore[attr-defined]
    outcomes: dict[int, tuple[str, Any]] = {}
    lock = threading.Lock()

    def worker(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=world_size, store=store)
        try:
            value = fn(rank, world_size, *args)
            with lock:
                outcomes[rank] = ("ok", value)
        except BaseException as exc:
            with lock:
                outcomes[rank] = ("error", "".join(traceback.format_exception(exc)))
            mtpg.ProcessLocalGroup.exception_handle(exc)
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    c10d._set_thread_isolation_mode(True)
    try:
        threads = [
            threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)
        ]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + timeout
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        mtpg.ProcessLocalGroup.reset()
    finally:
        mtpg._uninstall_threaded_pg()
        c10d._set_thread_isolation_mode(False)
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(outcomes.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        head = [f"ranks {missing} did not finish within {timeout:.0f} s"] if missing else []
        raise DistributedFailure("\n".join(head + errors))
    return [outcomes[r][1] for r in range(world_size)]


def expect_error_on_every_rank(
    fn: Callable[[Any], object],
    error: type[BaseException],
    fragments: Sequence[str] = (),
    *,
    world_size: int = 2,
    mesh_shape: tuple[int, ...] | None = None,
    timeout: float = 60.0,
    hint: str = "",
) -> list[str]:
    """Run ``fn(mesh)`` on ``world_size`` threaded ranks and assert that every rank raises
    ``error`` with a message containing every fragment (the bad-input catalogues use it).

    Returns each rank's message. ``hint`` is appended to a failure (e.g. where the bug is).
    """
    from torch.distributed.device_mesh import init_device_mesh

    def body(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", mesh_shape or (world,))
        try:
            fn(mesh)
        except error as exc:
            return f"ok: {exc}"
        except Exception as exc:
            return f"wrong type {type(exc).__name__}: {exc}"
        return "no error"

    messages = run_threaded(body, world_size, timeout=timeout)
    for rank, message in enumerate(messages):
        missing = [f for f in fragments if f not in message]
        if not message.startswith("ok: ") or missing:
            raise AssertionError(
                f"rank {rank}: expected {error.__name__} naming {list(fragments)}"
                f", got: {message}" + (f"\n({hint})" if hint else "")
            )
    return [m[len("ok: ") :] for m in messages]


def run_readme_example(
    readme: str | os.PathLike[str],
    example: str | os.PathLike[str],
    *,
    index: int = 0,
    timeout: float = 300.0,
) -> str:
    """Check that the ``index``-th fenced python block of ``readme`` is the file ``example``
    (the README shows the file a user runs), then run that file in a new interpreter.

    Returns its stdout; raises ``AssertionError`` naming the README and the file if the block and
    the file differ, or with the script's output if it fails.
    """
    import re
    import subprocess
    from pathlib import Path

    blocks = re.findall(r"```python\n(.*?)```", Path(readme).read_text(), flags=re.S)
    if len(blocks) <= index:
        raise AssertionError(f"{readme} has {len(blocks)} python examples, wanted #{index}")
    if blocks[index] != Path(example).read_text():
        raise AssertionError(f"{readme}: python example #{index} is not the text of {example}")
    done = subprocess.run(
        [sys.executable, str(example)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"{example} failed:\n{done.stdout}\n{done.stderr}")
    return done.stdout


_COUNTED = (
    "all_gather_single",
    "all_gather_into_tensor",
    "all_gather",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "reduce_scatter",
    "all_reduce",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "scatter",
    "gather",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "all_gather_object",
    "broadcast_object_list",
)


class CollectiveCounter:
    """Per-thread tally of ``torch.distributed`` collective calls and the bytes they send.

    ``calls`` maps a collective's name to how many times this thread (rank) issued it; ``bytes``
    to the bytes of its input tensors. It sees calls made through ``torch.distributed.<name>``
    (every package here calls collectives that way), not torch-internal functional collectives.
    """

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def record(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        size = 0
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                size = max(size, value.numel() * value.element_size())
        self.bytes[name] = self.bytes.get(name, 0) + size


_counter_state = threading.local()
_counter_lock = threading.Lock()
_counter_depth = 0
_originals: dict[str, Callable[..., Any]] = {}


def _counting(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stack: list[CollectiveCounter] = getattr(_counter_state, "stack", [])
        for counter in stack:
            counter.record(name, args, kwargs)
        return original(*args, **kwargs)

    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    return wrapper


class count_collectives:
    """``with count_collectives() as c: ...`` then ``c.calls`` / ``c.bytes`` / ``c.total``."""

    def __enter__(self) -> CollectiveCounter:
        global _counter_depth
        with _counter_lock:
            if _counter_depth == 0:
                for name in _COUNTED:
                    original = getattr(dist, name)
                    _originals[name] = original
                    setattr(dist, name, _counting(name, original))
            _counter_depth += 1
        self.counter = CollectiveCounter()
        stack = getattr(_counter_state, "stack", None)
        if stack is None:
            stack = _counter_state.stack = []
        stack.append(self.counter)
        return self.counter

    def __exit__(self, *exc: object) -> None:
        global _counter_depth
        _counter_state.stack.remove(self.counter)
        with _counter_lock:
            _counter_depth -= 1
            if _counter_depth == 0:
                for name, original in _originals.items():
                    setattr(dist, name, original)
                _originals.clear()


if sys.platform == "win32":  # pragma: no cover
    raise ImportError("ragged_dtensor.testing needs fork-free POSIX process spawning")
