"""Real gloo processes for tests: ``run_processes`` (re-exported by ``ragged_dtensor.testing``)."""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["STARTUP_FAULT_ENV", "DistributedFailure", "free_port", "run_processes"]

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
