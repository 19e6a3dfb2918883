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
import pickle
import queue
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

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


class DistributedFailure(RuntimeError):
    """One or more ranks raised, or did not finish within the timeout."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


# [Note: startup retry]
# Under load (CI beside other jobs, 2 cores) a gloo rank's startup can fail: one rank's full-mesh
# connect sees "Connection closed by peer" or a rendezvous wait times out while its peers are
# still being scheduled. Such a failure happens before the test body runs, so the whole set of
# ranks can be started again without repeating any of the test's work. Each rank reports a
# failure of ``init_process_group`` or of the first barrier (which proves the mesh connected) as
# "startup"; the parent then ends every rank and starts them all again on a fresh store, a
# bounded number of times. Failures inside the test body are never retried.
STARTUP_ATTEMPTS = 3
# Fault injection for the retry's own test: a path; the first rank to create that file fails its
# startup once (every later attempt finds the file and starts normally).
STARTUP_FAULT_ENV = "RAGGED_DTENSOR_TESTING_STARTUP_FAULT"


def _injected_startup_fault() -> None:
    marker = os.environ.get(STARTUP_FAULT_ENV)
    if marker is None:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return
    raise ConnectionError(f"injected startup fault ({STARTUP_FAULT_ENV}={marker})")


def _process_entry(
    rank: int,
    world_size: int,
    port: int,
    timeout: float,
    fn: Callable[..., Any],
    args: Sequence[Any],
    results: Any,
    env: dict[str, str],
    threads: int,
) -> None:
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        try:
            # the store's server is the parent's (it holds its port from bind to the end: no
            # other process can take it between choosing and binding, as with a port chosen then
            # freed)
            store = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=timeout)
            )
            dist.init_process_group(
                "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout),
            )
            dist.barrier()
            _injected_startup_fault()
        except BaseException:
            results.put((rank, "startup", traceback.format_exc()))
            return
        value = fn(rank, world_size, *args)
        # Plain pickle bytes: torch's queue pickler would share tensor storage through file
        # descriptors that die with this process before the parent reads them.
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_processes(
    fn: Callable[..., T],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    threads: int = 1,
) -> list[T]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned gloo processes.

    Each rank runs with ``threads`` intra-op threads (``torch.set_num_threads``; one by default,
    so ranks do not oversubscribe the cores). The thread count changes the order of a kernel's
    internal reductions: a bitwise comparison against a reference computed in the calling
    process must run that reference with the same count (``torch.set_num_threads(threads)``).

    Returns the per-rank return values (they must be picklable). Raises ``DistributedFailure`` with
    the failing ranks' tracebacks, or naming the ranks still running after ``timeout`` seconds
    (those are killed: a hang can never outlive the test).
    """
    for attempt in range(1, STARTUP_ATTEMPTS + 1):
        outcomes, codes = _run_once(fn, world_size, args, timeout, env or {}, threads)
        startup = {r: v for r, (s, v) in outcomes.items() if s == "startup"}
        if not startup:
            break
        if attempt == STARTUP_ATTEMPTS:
            errors = [f"--- rank {r} (startup) ---\n{v}" for r, v in sorted(startup.items())]
            raise DistributedFailure(
                f"the {world_size} gloo ranks failed to start {STARTUP_ATTEMPTS} times in a row "
                "(init_process_group or the first barrier); the last attempt's errors:\n"
                + "\n".join(errors)
            )
        print(
            f"run_processes: ranks {sorted(startup)} failed at startup (attempt {attempt} of "
            f"{STARTUP_ATTEMPTS}); starting all {world_size} ranks again",
            file=sys.stderr,
        )
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(outcomes.items()) if s == "error"]
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        lines = []
        if missing:
            missing_codes = {r: codes[r] for r in missing}
            if all(code is not None for code in missing_codes.values()):
                lines.append(
                    f"ranks {missing} exited without reporting (exit codes {missing_codes}; a "
                    f"negative code is the signal that killed it; see their stderr)"
                )
            else:
                lines.append(
                    f"ranks {missing} did not finish within {timeout:.0f} s "
                    f"(exit codes {missing_codes}; None: still running when killed)"
                )
        raise DistributedFailure("\n".join(lines + errors))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def _run_once(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any],
    timeout: float,
    env: dict[str, str],
    threads: int,
) -> tuple[dict[int, tuple[str, Any]], dict[int, int | None]]:
    """One start of ``world_size`` ranks on a fresh store: each rank's (status, value) as
    reported, and every rank's exit code (None: killed while still running)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    server = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout),
    )
    port = server.port
    procs = [
        ctx.Process(
            target=_process_entry,
            args=(rank, world_size, port, timeout, fn, args, results, env, threads),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    outcomes: dict[int, tuple[str, Any]] = {}
    first_error_at: float | None = None
    try:
        while len(outcomes) < world_size:
            now = time.monotonic()
            # After one rank fails, the others may block in a collective forever: give them a
            # short grace period, then stop waiting.
            limit = deadline if first_error_at is None else min(deadline, first_error_at + 10.0)
            if now >= limit:
                break
            try:
                rank, status, value = results.get(timeout=min(1.0, limit - now))
            except queue.Empty:
                if all(not p.is_alive() for p in procs) and results.empty():
                    break
                continue
            outcomes[rank] = (status, value)
            if status == "startup":
                break  # every rank starts again: nothing to wait for
            if status != "ok" and first_error_at is None:
                first_error_at = time.monotonic()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        del server  # the store's port is released with the last reference
    return outcomes, {rank: proc.exitcode for rank, proc in enumerate(procs)}


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
