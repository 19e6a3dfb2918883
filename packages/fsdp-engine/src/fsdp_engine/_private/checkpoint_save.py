"""Atomically committed, integrity-checked ``torch.distributed.checkpoint`` (DCP) saves.

[Note: commit protocol]
A checkpoint is loadable only once it is complete, so a crash at any point of a save (a killed
rank, a full disk, a preempted job) must leave either the previous state or the new one, never a
directory that loads half-written or mixed data. The save runs in four phases:

1. rank 0 removes partial directories that earlier saves under the same root left behind (a
   root belongs to one job, which saves one checkpoint at a time, so any ``.<name>.partial``
   there is dead), draws the save's identifier (a random UUID) and broadcasts both.
2. every rank writes its shards with DCP into the sibling ``.<name>.partial`` (DCP's own finish
   step makes rank 0 write ``.metadata``, which records the save identifier), then hashes the
   files it wrote (see [Note: integrity] in ``checkpoint_files``) and sends the digests to
   rank 0 (a gather: rank 0 continues only when every rank's files are on disk).
3. rank 0 writes the ``COMMITTED`` marker (save identifier, commit time, every file's digests)
   inside the partial directory, fsyncs it and the directory, renames the directory to its final
   name (atomic on POSIX filesystems) and atomically replaces the parent's ``latest`` pointer.
4. rank 0 broadcasts exactly what happened: no rank returns before the checkpoint is visible,
   and on a failure every rank raises the same error (none waits in a barrier).

A failure before the rename leaves nothing: the partial directory is removed (and the next save
under the root removes it if that failed too). A crash before the rename leaves only the hidden
``.<name>.partial`` without a marker, which is never loaded. A failure after the rename (syncing
the parent, updating ``latest``) raises ``AfterCommitError``, which says that the checkpoint *is*
committed, and, when the pointer could not be updated, whether the stale pointer could be removed
(``latest_checkpoint`` then finds the new checkpoint by commit time).

Phase 1's cleanup is why saves of one process run one at a time: every save (synchronous or
not) first waits for this process's asynchronous saves still writing (``wait_for_pending``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from fsdp_engine._private import checkpoint_files
from fsdp_engine._private.checkpoint_checks import (
    check_every_rank,
    check_replicated,
    check_state_dict,
)
from fsdp_engine._private.checkpoint_common import (
    COMMIT_MARKER,
    DCP_METADATA,
    FORMAT,
    LATEST_POINTER,
    describe,
    failures,
    fsync_dir,
    on_rank0,
    partial_path,
    rank_of,
    share_from_rank0,
    world_of,
    write_durably,
)
from fsdp_engine._private.checkpoint_errors import AfterCommitError, CheckpointError

__all__ = ["SaveRequest", "check_locally", "save_checkpoint", "wait_for_pending", "write"]


@attrs.frozen
class SaveRequest:
    """One save, checked on every rank: where it goes and what its marker records."""

    op: str  # the public function, named in every message
    final: Path
    digest: str
    metadata: dict[str, Any]
    check_replicated: bool

    @property
    def partial(self) -> Path:
        return partial_path(self.final)


# Asynchronous saves of this process still writing (``checkpoint_async`` registers a waiter per
# save; a waiter blocks until its save finished, and reports what the caller never retrieved).
_PENDING: list[Callable[[str], None]] = []


def wait_for_pending(op: str) -> None:
    """Block until every asynchronous save of this process finished (see the module note)."""
    while _PENDING:
        _PENDING.pop(0)(op)


def check_locally(
    state_dict: Any,
    path: str | os.PathLike[str],
    *,
    op: str,
    metadata: Mapping[str, Any] | None,
    check_replicated: bool,
    digest: str,
) -> tuple[SaveRequest, Exception | None]:
    """The request, and what is wrong with it on this rank (``None``: nothing); the caller
    then lets every rank agree (``check_every_rank``) before any collective of the save."""
    final = Path(path)
    error: Exception | None = check_state_dict(state_dict, op)
    record: dict[str, Any] = {}
    if error is None and digest not in checkpoint_files.DIGESTS:
        error = ValueError(f"{op}: digest={digest!r}; expected one of {checkpoint_files.DIGESTS}")
    if error is None:
        try:  # a copy (the caller may change its dict while an asynchronous save runs)
            record = json.loads(json.dumps(dict(metadata or {})))
        except (TypeError, ValueError) as exc:
            error = TypeError(
                f"{op}: metadata must be a JSON-serializable mapping (it goes into the "
                f"{COMMIT_MARKER} marker), got {describe(exc)}"
            )
    if error is None and final.exists():
        error = FileExistsError(
            f"{op}: {str(final)!r} already exists; checkpoints are never "
            f"overwritten in place (save under a new step directory)"
        )
    return SaveRequest(op, final, digest, record, check_replicated), error


def save_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    metadata: Mapping[str, Any] | None = None,
    check_replicated: bool = True,
    digest: str = "crc32",
) -> Path:
    """Save ``state_dict`` with DCP to the directory ``path``, committed atomically.

    Collective: every rank of ``process_group`` (default: the world) calls it with its own
    shards (``get_state_dict(model, optimizer)`` gives sharded ``RaggedShard`` DTensors).
    The data is written to ``.<name>.partial`` next to ``path`` and hashed, then rank 0 writes
    the ``COMMITTED`` marker (``metadata`` as JSON, the save identifier, the commit time and
    every file's digests), renames the directory into place and points ``<parent>/latest`` at
    it. ``path`` must not exist yet. Returns ``path``. An asynchronous save of this process
    still writing (``async_save_checkpoint``) is waited for first.

    Raises ``CheckpointError`` on every rank when the save fails (nothing is committed and the
    partial directory is removed), ``AfterCommitError`` when the checkpoint was committed but a
    later step failed. ``check_replicated``: compare plain tensors across ranks first and raise
    naming any that differ (DCP would silently keep one rank's copy).
    """
    op = "save_checkpoint"
    wait_for_pending(op)
    request, error = check_locally(
        state_dict,
        path,
        op=op,
        metadata=metadata,
        check_replicated=check_replicated,
        digest=digest,
    )
    check_every_rank(request.final, error, op, process_group)
    return write(state_dict, request, process_group)


def write(
    state_dict: dict[str, Any], request: SaveRequest, group: dist.ProcessGroup | None
) -> Path:
    """Phases 1-4 of [Note: commit protocol] for a checked request; collectives on ``group``
    only (an asynchronous save runs this in its writer thread, on the writer's group)."""
    op, final, partial = request.op, request.final, request.partial
    rank = rank_of(group)
    if request.check_replicated:
        check_replicated(state_dict, group, op)
    # Rank 0 alone touches the directories; the others learn its outcome (no one is left
    # waiting in a barrier if it fails).
    failure, save_id = share_from_rank0(on_rank0(rank, lambda: _prepare(final)), group)
    if failure is not None:
        raise CheckpointError(
            f"{op}: preparing {str(final)!r} failed on rank 0 ({failure}); nothing "
            f"was written and earlier checkpoints are untouched"
        )
    writer = checkpoint_files.DigestingWriter(partial, save_id, request.digest)
    try:
        dcp_save(
            state_dict,
            storage_writer=writer,
            process_group=group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:  # a BaseException: callers' ``except Exception`` miss it
        # Every rank is past DCP's write step (DCP gathered its outcome): the directory is ours.
        cleanup = share_from_rank0(on_rank0(rank, lambda: _remove(partial))[0], group)
        raise CheckpointError(
            failures(f"{op}: writing", final, exc)
            + f"\nNothing was committed; {_removal(partial, cleanup)}"
        ) from exc
    files = checkpoint_files.gather_digests(writer, group)
    record = {
        "format": FORMAT,
        "save_id": save_id,
        "digest": request.digest,
        "world_size": world_of(group),
        "metadata": request.metadata,
        "files": files,
    }
    try:
        failure, report = share_from_rank0(
            on_rank0(rank, lambda: _commit(partial, final, record, op)), group
        )
    except Exception as exc:  # the outcome could not be shared: a rank died, the group broke
        _raise_if_committed(final, save_id, op, exc)
        raise
    if failure is not None:  # _commit reports its own failures; this is anything else
        raise CheckpointError(f"{op}: committing {str(final)!r} failed: {failure}")
    if report["error"] is not None:
        error = AfterCommitError if report["committed"] else CheckpointError
        raise error(report["error"])
    return final


def _raise_if_committed(final: Path, save_id: str, op: str, exc: Exception) -> None:
    """Phase 4 failed (rank 0's broadcast of the outcome; a rank that died after the commit
    breaks it): when this save's marker is in ``final`` (rank 0's disk, or a filesystem every
    rank shares) the checkpoint IS committed, and the error says so (``AfterCommitError``)."""
    try:
        marker = json.loads((final / COMMIT_MARKER).read_text())
    except (OSError, ValueError):
        return  # not visible from this rank: the caller re-raises the original error
    if isinstance(marker, dict) and marker.get("save_id") == save_id:
        raise AfterCommitError(
            f"{op}: {str(final)!r} IS committed and loadable (its {COMMIT_MARKER} marker holds "
            f"this save's identifier), but sharing the outcome with every rank failed after "
            f"the commit ({describe(exc)}): a rank may have died or left after the commit"
        ) from exc


def _prepare(final: Path) -> str:
    """Rank 0, before writing: the parent exists, no stale partial directory is left in it
    (see [Note: commit protocol]); returns the new save's identifier."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for child in final.parent.iterdir():
        if child.name.startswith(".") and child.name.endswith(".partial") and child.is_dir():
            shutil.rmtree(child)
    return uuid.uuid4().hex


def _remove(directory: Path) -> None:
    if directory.exists():
        shutil.rmtree(directory)


def _removal(partial: Path, failure: str | None) -> str:
    if failure is None:
        return f"the partial directory {str(partial)!r} was removed"
    return (
        f"removing the partial directory {str(partial)!r} failed too ({failure}); the next "
        f"save under {str(partial.parent)!r} removes it"
    )


def _commit(partial: Path, final: Path, record: dict[str, Any], op: str) -> dict[str, Any]:
    """Rank 0: marker, rename, pointer, each durable before the next; reports exactly how far
    it got: ``{"committed": bool, "error": message or None}``."""
    step = "hashing .metadata"
    try:
        metadata_path = partial / DCP_METADATA
        record["files"][DCP_METADATA] = checkpoint_files.file_record(
            metadata_path, [], record["digest"]
        )
        record["time"] = time.time()
        step = f"writing the {COMMIT_MARKER} marker"
        write_durably(partial / COMMIT_MARKER, json.dumps(record, sort_keys=True))
        step = "syncing the partial directory"
        fsync_dir(partial)
        step = f"renaming {str(partial)!r} to {str(final)!r}"
        os.rename(partial, final)
    except Exception as exc:
        cleanup: str | None = None
        try:
            _remove(partial)
        except Exception as again:
            cleanup = describe(again)
        return {
            "committed": False,
            "error": (
                f"{op}: committing {str(final)!r} failed on rank 0 while {step} "
                f"({describe(exc)}); the checkpoint was NOT committed, "
                f"{_removal(partial, cleanup)}, and earlier checkpoints are untouched"
            ),
        }
    try:
        step = "syncing the parent directory"
        fsync_dir(final.parent)
        step = f"updating the {LATEST_POINTER!r} pointer"
        pointer = final.parent / f".{LATEST_POINTER}.tmp"
        write_durably(pointer, final.name)
        os.replace(pointer, final.parent / LATEST_POINTER)
        fsync_dir(final.parent)
    except Exception as exc:
        return {"committed": True, "error": _after_commit(final, step, exc, op)}
    return {"committed": True, "error": None}


def _after_commit(final: Path, step: str, exc: Exception, op: str) -> str:
    head = (
        f"{op}: {str(final)!r} IS committed and loadable, but {step} failed on "
        f"rank 0 ({describe(exc)})"
    )
    if "pointer" not in step:
        return head + "; the rename may not survive a power loss until the directory is synced"
    latest = final.parent / LATEST_POINTER
    try:
        if latest.exists() and latest.read_text().strip() != final.name:
            latest.unlink()
            return (
                head + f"; the stale {str(latest)!r} was removed, so latest_checkpoint finds "
                f"{final.name!r} by commit time"
            )
    except Exception as again:
        return (
            head + f"; the stale {str(latest)!r} could not be removed either "
            f"({describe(again)}): latest_checkpoint follows it until it is fixed"
        )
    return head + f"; latest_checkpoint finds {final.name!r} by commit time"
