"""``async_save_checkpoint``: the training thread stages; a writer writes, hashes and commits.

[Note: asynchronous saves]
``dcp.async_save`` copies the state dict to CPU memory on the calling thread and runs DCP's save
in a background thread, returning a future. ``async_save_checkpoint`` does the same for the
committed, integrity-checked save of ``save_checkpoint``:

- on the training thread: wait for this process's previous asynchronous save (one save at a
  time: the staged copies held stay bounded, and the commit protocol's cleanup of dead partial
  directories never meets a live one); the local checks of ``save_checkpoint``; the copy to CPU
  ([Note: staging] in ``checkpoint_staging``: from device tensors it runs on a copy stream,
  issued by a stager thread, and only the next optimizer step waits for it, [Note: staging
  without a stall]); the copy goes to the writer and the call returns.
  No collective: the stall is this rank's own work, never a wait for a slower rank. A check
  that fails here raises here (and the writer still tells the other ranks);
- on the writer thread: first the wait for the device-to-host copies (a failed copy becomes
  this rank's error), then one small all-gather in which every rank learns that every rank
  named the same path, passed its checks and staged (else every rank's ``result()`` raises
  the same error, and nothing was written); the check of plain tensors across ranks; then
  phases 1-4 of [Note: commit protocol]: DCP writes the files, the digests of every byte range
  are computed there (off the training thread), rank 0 commits atomically, every rank learns
  the outcome.

The writer's collectives run on a process group of its own (gloo, the ranks of
``process_group`` and its timeout, made by the first asynchronous save of that group, a
collective of its ranks), so they never interleave with the training's collectives on
``process_group``;
``dcp.async_save`` asks the caller for the same (a CPU backend). One writer thread per process
group, at the lowest CPU priority (nice 19 on Linux, that thread only): its work (DCP's
serialization, the writes, the digests) takes the cores training leaves idle, and on a machine
whose cores training keeps busy it yields to training instead of slowing its steps.

The handle's ``result()`` returns the path or raises what ``save_checkpoint`` raises, the same on
every rank. A failure nobody retrieved is not lost: the next save of this process (either API)
and the interpreter's exit warn with it. A process ending while a save writes (the interpreter
joins the writer thread at exit) finishes it first; call ``result()`` before
``dist.destroy_process_group()``, which tears down the writer's group too. A rank killed while
its writer writes leaves a partial directory without a marker: the previous checkpoint stays
``latest`` and loads (``test_engine_reliability_killed_rank``).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist

from fsdp_engine._private import checkpoint_save
from fsdp_engine._private.checkpoint_checks import check_every_rank
from fsdp_engine._private.checkpoint_common import describe
from fsdp_engine._private.checkpoint_errors import CheckpointError
from fsdp_engine._private.checkpoint_save import SaveRequest, check_locally, wait_for_pending
from fsdp_engine._private.checkpoint_staging import StagedStateDict, stage_state_dict

__all__ = ["AsyncSaveHandle", "async_save_checkpoint"]

_OP = "async_save_checkpoint"


class AsyncSaveHandle:
    """One asynchronous save, as ``async_save_checkpoint`` returned it (like DCP's future).

    ``result(timeout=None)``: the checkpoint's path once committed; raises what
    ``save_checkpoint`` raises (``CheckpointError``, ``AfterCommitError``, the same on every
    rank), or ``TimeoutError`` when ``timeout`` seconds pass first. ``wait(timeout=None)``: block
    until the save finished, ``True`` once it has (never raises). ``done()``: finished, either
    way. ``exception(timeout=None)``: the error, or ``None`` after a commit.
    """

    def __init__(self, path: Path, future: Future[Path]) -> None:
        self._path = path
        self._future = future
        self._retrieved = False  # an error was raised to, or read by, the caller

    @property
    def path(self) -> Path:
        """Where the checkpoint is committed when the save succeeds."""
        return self._path

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> bool:
        wait_futures([self._future], timeout=timeout)
        return self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        try:
            return self._future.result(timeout)
        finally:
            if self._future.done():
                self._retrieved = True

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = self._future.exception(timeout)
        self._retrieved = True
        return error

    def __repr__(self) -> str:
        state = "writing"
        if self._future.done():
            error = self._future.exception()
            state = "committed" if error is None else f"failed: {describe(error)}"
        return f"AsyncSaveHandle({str(self._path)!r}, {state})"

    def _finish(self, op: str) -> None:
        """Wait for the save; warn with its error if nobody retrieved it (``_PENDING``)."""
        self.wait()
        error = self._future.exception()
        if error is not None and not self._retrieved:
            self._retrieved = True
            warnings.warn(
                f"{op}: the asynchronous save of {str(self._path)!r} failed and nobody "
                f"retrieved its error (call .result() on the handle async_save_checkpoint "
                f"returned): {describe(error)}",
                RuntimeWarning,
                stacklevel=4,
            )


@attrs.define
class _Writer:
    parent: Any  # the process group the saves are collective over (None: no process group)
    group: dist.ProcessGroup | None
    executor: ThreadPoolExecutor


_WRITERS: list[_Writer] = []


def _alive(group: dist.ProcessGroup | None) -> bool:
    if group is None:
        return True
    try:
        dist.get_world_size(group)
    except (RuntimeError, ValueError):  # destroyed with destroy_process_group
        return False
    return True


def timeout_of(group: dist.ProcessGroup) -> timedelta | None:
    """``group``'s collective timeout (``None``: unknown, the default). The writer's group takes
    it: a writer waiting for a dead rank gives up when training's collectives do, instead of
    holding the interpreter's exit for gloo's default 30 minutes."""
    for device in getattr(group, "_device_types", ()):
        with contextlib.suppress(Exception):  # torch's private accessors, per backend
            timeout = group._get_backend(device).options._timeout
            if isinstance(timeout, timedelta):
                return timeout
    return None


def _lowest_cpu_priority() -> None:
    """The writer thread takes the cores training leaves idle: nice 19 for this thread alone
    (Linux: a thread id is a ``PRIO_PROCESS`` target); elsewhere it keeps its priority."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _writer_for(process_group: dist.ProcessGroup | None) -> _Writer:
    """The writer of ``process_group`` (made at its first asynchronous save: a collective of
    its ranks when there is a process group)."""
    parent = None if not dist.is_initialized() else (process_group or dist.group.WORLD)
    for writer in _WRITERS:
        if writer.parent is parent and _alive(writer.group):
            return writer
    group = None
    if parent is not None:
        if not dist.is_gloo_available():
            raise CheckpointError(
                f"{_OP}: the writer thread needs a gloo process group of its own (its "
                f"collectives must not interleave with training's); this torch has no gloo"
            )
        ranks = dist.get_process_group_ranks(parent)
        group = dist.new_group(
            ranks, backend="gloo", timeout=timeout_of(parent), use_local_synchronization=True
        )
    name = f"fsdp_engine-checkpoint-writer-{len(_WRITERS)}"
    executor = ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=_lowest_cpu_priority
    )
    writer = _Writer(parent, group, executor)
    _WRITERS.append(writer)
    return writer


def _write(
    staged: StagedStateDict | None,
    request: SaveRequest,
    error: Exception | None,
    group: dist.ProcessGroup | None,
) -> Path:
    """The writer's job (see [Note: asynchronous saves]); every rank submits one, failed or not,
    so every rank's writer meets the others in the same collectives."""
    if error is None and staged is not None:
        try:  # before the agreement: a copy that failed on the stager thread is told to all
            staged.wait()
        except Exception as exc:
            error = CheckpointError(
                f"{_OP}: copying the state dict to CPU memory failed ({describe(exc)})"
            )
    try:
        check_every_rank(request.final, error, _OP, group)
        assert staged is not None
        return checkpoint_save.write(staged.state_dict, request, group)
    finally:
        if staged is not None:
            staged.release()  # the pinned buffers go back to the pool for the next save


def async_save_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    metadata: Mapping[str, Any] | None = None,
    check_replicated: bool = True,
    digest: str = "crc32",
) -> AsyncSaveHandle:
    """``save_checkpoint`` in the background: copy ``state_dict`` to CPU memory, return.

    Collective, with ``save_checkpoint``'s arguments and checks (see [Note: asynchronous
    saves]). Returns once this rank has its copy, so training may change the parameters and
    optimizer state at once; a writer thread then checks that every rank got this far, writes
    the files, computes their digests and commits the checkpoint atomically. Waits first for
    this process's previous asynchronous save, if one is still writing. Raises at once what is
    wrong on this rank before the write (bad arguments, an existing ``path``, a failed copy);
    the write's outcome, and another rank's early failure, come from the handle's ``result()``,
    the same on every rank.
    """
    wait_for_pending(_OP)
    request, error = check_locally(
        state_dict,
        path,
        op=_OP,
        metadata=metadata,
        check_replicated=check_replicated,
        digest=digest,
    )
    staged: StagedStateDict | None = None
    if error is None:
        try:
            staged = stage_state_dict(state_dict)
        except Exception as exc:  # the other ranks learn it from the writer's agreement
            error = CheckpointError(
                f"{_OP}: copying the state dict to CPU memory failed ({describe(exc)})"
            )
    writer = _writer_for(process_group)
    future = writer.executor.submit(_write, staged, request, error, writer.group)
    handle = AsyncSaveHandle(request.final, future)
    checkpoint_save._PENDING.append(handle._finish)
    if error is not None:
        handle._retrieved = True  # raised here; the writer's agreement tells the other ranks
        raise error
    return handle


atexit.register(wait_for_pending, "at exit")
