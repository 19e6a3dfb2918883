"""Atomically committed ``torch.distributed.checkpoint`` (DCP) checkpoints.

[Note: commit protocol]
A checkpoint is loadable only once it is complete, so a crash at any point of a save (a killed
rank, a full disk, a preempted job) must leave either the previous state or the new one, never a
directory that loads half-written or mixed data. The save runs in four phases:

1. rank 0 removes a stale partial directory left by an earlier crashed save of the same path and
   broadcasts its outcome (the broadcast is the barrier of the phase).
2. every rank writes its shards with DCP into the sibling ``.<name>.partial`` (DCP's own finish
   step makes rank 0 write ``.metadata`` after gathering every rank's write results).
3. barrier (every rank's files are on disk); rank 0 writes the ``COMMITTED`` marker inside the
   partial directory, fsyncs it and the directory, then renames the directory to its final name
   (atomic on POSIX filesystems) and atomically replaces the parent's ``latest`` pointer.
4. rank 0 broadcasts the commit's outcome: no rank returns before the checkpoint is visible,
   and if the commit failed every rank raises ``CheckpointError`` (none waits in a barrier).

A crash before the rename leaves only ``.<name>.partial`` (never picked up: its name is hidden and
it has no marker); a crash between the rename and the pointer update leaves a complete directory
that ``latest_checkpoint`` still finds by scanning. ``load_checkpoint`` refuses any directory
without the marker, naming it.

[Note: per-rank plain tensors]
DCP treats a plain (non-DTensor) tensor as replicated: it keeps one rank's copy (deduplication)
and hands that copy to every rank on load. A plain tensor that differs between ranks, e.g. the
local shard of an optimizer state kept outside a DTensor, would be silently lost on every rank
but one. Before writing anything the save compares a digest of every plain tensor across ranks
and refuses (naming the key and the ranks) when they differ.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

__all__ = [
    "COMMIT_MARKER",
    "CheckpointError",
    "IncompleteCheckpointError",
    "checkpoint_info",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

COMMIT_MARKER = "COMMITTED"
LATEST_POINTER = "latest"
_FORMAT = 1
_STEP_RE = re.compile(r"(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded as asked (the message names the path or key)."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """The directory is not a committed checkpoint: its save never finished (or it is not one)."""


def _partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_durably(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _plain_tensors(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, DTensor):
        return
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _plain_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _plain_tensors(item, f"{prefix}.{index}")


def _digest(tensor: torch.Tensor) -> str:
    """Shape, dtype and a CRC of the bytes: equal on every rank iff the tensor is replicated."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{tuple(tensor.shape)}/{tensor.dtype}/{zlib.crc32(data):08x}"


def _check_replicated(state_dict: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """Refuse plain tensors that differ between ranks (DCP would keep only one rank's copy)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = {key: _digest(t) for key, t in _plain_tensors(state_dict, "")}
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    problems = []
    for key in sorted({k for d in gathered for k in d}):
        values = [d.get(key) for d in gathered]
        if len(set(values)) > 1:
            by_value: dict[str | None, list[int]] = {}
            for rank, v in enumerate(values):
                by_value.setdefault(v, []).append(rank)
            detail = "; ".join(
                f"ranks {ranks}: {v if v is not None else 'missing'}"
                for v, ranks in by_value.items()
            )
            problems.append(f"  {key!r}: {detail}")
    if problems:
        raise CheckpointError(
            "save_checkpoint: these plain (non-DTensor) tensors differ between ranks. DCP "
            "treats a plain tensor as replicated and would keep only one rank's copy, so the "
            "others' data would be silently lost (per-rank state must be a DTensor, e.g. a "
            "RaggedShard with its parameter's placement):\n" + "\n".join(problems)
        )


def save_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    metadata: Mapping[str, Any] | None = None,
    check_replicated: bool = True,
) -> Path:
    """Save ``state_dict`` with DCP to the directory ``path``, committed atomically.

    Collective: every rank of ``process_group`` (default: the world) calls it with its own
    shards (``get_state_dict(model, optimizer)`` gives sharded ``RaggedShard`` DTensors).
    The data is written to ``.<name>.partial`` next to ``path``, then rank 0 writes the
    ``COMMITTED`` marker (holding ``metadata``, JSON) and renames the directory into place, and
    points ``<parent>/latest`` at it. ``path`` must not exist yet. Returns ``path``.

    ``check_replicated``: compare plain tensors across ranks first and raise
    ``CheckpointError`` naming any that differ (DCP would silently keep one rank's copy).
    """
    final = Path(path)
    partial = _partial_path(final)
    rank = _rank(process_group)
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    local_error: Exception | None = _check_state_dict(state_dict, "save_checkpoint")
    if local_error is None and final.exists():
        local_error = FileExistsError(
            f"save_checkpoint: {str(final)!r} already exists; checkpoints are never "
            f"overwritten in place (save under a new step directory)"
        )
    _check_every_rank(final, local_error, "save_checkpoint", process_group)
    if check_replicated:
        _check_replicated(state_dict, process_group)
    # Rank 0 alone touches the directories; the others learn its outcome (no one is left
    # waiting in a barrier if it fails).
    outcome = _run_on_rank0(rank, lambda: _clear_partial(final, partial))
    _agree(outcome, final, "preparing", process_group)
    try:
        dcp_save(
            state_dict,
            storage_writer=FileSystemWriter(partial),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:  # a BaseException: callers' ``except Exception`` miss it
        raise CheckpointError(_failures("save_checkpoint: writing", final, exc)) from exc
    _barrier(process_group)  # every rank's files are on disk
    record = {
        "format": _FORMAT,
        "world_size": world,
        "time": time.time(),
        "metadata": dict(metadata or {}),
    }
    outcome = _run_on_rank0(rank, lambda: _commit(partial, final, record))
    _agree(outcome, final, "committing", process_group)
    return final


def _all_tensors(value: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _all_tensors(item, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _all_tensors(item, f"{prefix}.{index}")


def _check_state_dict(state_dict: Any, op: str) -> Exception | None:
    """A dict, and no tensor without data (meta): DCP would fail deep inside, unnamed."""
    if not isinstance(state_dict, dict):
        return TypeError(f"{op}: state_dict must be a dict, got {type(state_dict).__name__}")
    meta = [
        key
        for key, tensor in _all_tensors(state_dict, "")
        if (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).is_meta
    ]
    if meta:
        shown = ", ".join(repr(k) for k in meta[:5]) + (
            f" and {len(meta) - 5} more" if len(meta) > 5 else ""
        )
        return CheckpointError(
            f"{op}: {shown} {'is' if len(meta) == 1 else 'are'} on the meta device (no data): "
            f"materialize the model first (to_empty(device=...) and initialize or load)"
        )
    return None


def _check_every_rank(
    path: Path, error: Exception | None, op: str, group: dist.ProcessGroup | None
) -> None:
    """Before any collective of DCP: every rank names the same path and none failed its local
    check, else every rank raises (a rank raising alone would leave the others waiting in
    DCP's collectives until the timeout; ranks writing to different paths would commit a
    checkpoint missing the others' files)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return
    mine = (os.path.abspath(path), None if error is None else f"{type(error).__name__}: {error}")
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, mine, group=group)
    paths: dict[str, list[int]] = {}
    errors: dict[str, list[int]] = {}
    for rank, (where, message) in enumerate(gathered):
        paths.setdefault(where, []).append(rank)
        if message is not None:
            errors.setdefault(message, []).append(rank)
    if len(paths) > 1:
        listed = "; ".join(f"ranks {ranks}: {where!r}" for where, ranks in paths.items())
        raise CheckpointError(f"{op}: the ranks were given different paths ({listed})")
    if error is not None:
        raise error
    if errors:
        listed = "; ".join(f"ranks {ranks}: {message}" for message, ranks in errors.items())
        raise CheckpointError(f"{op}: other ranks failed before starting ({listed})")


def _clear_partial(final: Path, partial: Path) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    if partial.exists():  # left by a crashed save of the same path
        shutil.rmtree(partial)


def _commit(partial: Path, final: Path, record: Mapping[str, Any]) -> None:
    """Marker, rename, pointer: each step durable before the next (see [Note: commit protocol])."""
    _write_durably(partial / COMMIT_MARKER, json.dumps(record, sort_keys=True))
    _fsync_dir(partial)
    os.rename(partial, final)
    _fsync_dir(final.parent)
    pointer = final.parent / f".{LATEST_POINTER}.tmp"
    _write_durably(pointer, final.name)
    os.replace(pointer, final.parent / LATEST_POINTER)
    _fsync_dir(final.parent)


def _run_on_rank0(rank: int, action: Callable[[], None]) -> str | None:
    if rank != 0:
        return None
    try:
        action()
    except Exception as exc:  # reported to every rank by _agree
        return f"{type(exc).__name__}: {exc}"
    return None


def _agree(
    outcome: str | None,
    final: Path,
    phase: str,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Broadcast rank 0's outcome (also the barrier of that phase); raise on every rank."""
    if dist.is_initialized():
        box: list[Any] = [outcome]
        src = 0 if group is None else dist.get_global_rank(group, 0)
        dist.broadcast_object_list(box, src=src, group=group)
        outcome = box[0]
    if outcome is not None:
        raise CheckpointError(
            f"save_checkpoint: {phase} {str(final)!r} failed on rank 0 ({outcome}); the "
            f"checkpoint was not committed and earlier checkpoints are untouched"
        )


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed checkpoint directory (has the ``COMMITTED`` marker)."""
    return (Path(path) / COMMIT_MARKER).is_file()


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The marker record of a committed checkpoint (``world_size``, ``metadata``, ...)."""
    directory = Path(path)
    if not is_complete_checkpoint(directory):
        raise IncompleteCheckpointError(_incomplete_message(directory))
    info: dict[str, Any] = json.loads((directory / COMMIT_MARKER).read_text())
    return info


def _incomplete_message(directory: Path) -> str:
    if not directory.exists():
        return f"no checkpoint at {str(directory)!r}: the directory does not exist"
    if not directory.is_dir():
        return f"{str(directory)!r} is not a checkpoint directory (it is a file)"
    return (
        f"{str(directory)!r} is not a committed checkpoint: it has no {COMMIT_MARKER} marker "
        f"(its save was interrupted, or it was not written by save_checkpoint); use "
        f"latest_checkpoint(<parent>) to find the newest complete one"
    )


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest committed checkpoint under ``root``, or ``None``.

    Follows ``root/latest`` when it names a committed directory; otherwise (a crash between the
    commit and the pointer update, a deleted directory) scans ``root`` for committed
    directories and picks the highest trailing number in the name (``step_00000120``), then the
    newest commit time. Partial directories are never returned.
    """
    base = Path(root)
    if not base.is_dir():
        return None
    pointer = base / LATEST_POINTER
    candidates: list[Path] = []
    if pointer.is_file():
        target = base / pointer.read_text().strip()
        if target != base and is_complete_checkpoint(target):
            candidates.append(target)
    found = [
        child
        for child in base.iterdir()
        if child.is_dir() and not child.name.startswith(".") and is_complete_checkpoint(child)
    ]

    def key(child: Path) -> tuple[int, float]:
        match = _STEP_RE.search(child.name)
        step = int(match.group(1)) if match else -1
        try:
            stamp = float(checkpoint_info(child)["time"])
        except (OSError, ValueError, KeyError):
            stamp = 0.0
        return step, stamp

    newest = max(found, key=key, default=None)
    if candidates and (newest is None or key(newest) <= key(candidates[0])):
        return candidates[0]
    return newest


def load_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load the committed checkpoint ``path`` into ``state_dict`` in place (DCP, any world size).

    Collective. Raises ``IncompleteCheckpointError`` (naming the path) for a directory without
    the ``COMMITTED`` marker, before any rank reads data. Keys of ``state_dict`` missing from the
    checkpoint, or of another shape, raise DCP's error naming the key. Returns the marker record.
    After it, ``set_state_dict(model, optimizer, ...)`` applies the values.
    """
    directory = Path(path)
    info: dict[str, Any] = {}
    local_error: Exception | None = _check_state_dict(state_dict, "load_checkpoint")
    try:
        info = checkpoint_info(directory)
    except (IncompleteCheckpointError, OSError, ValueError) as exc:
        local_error = local_error or exc
    _check_every_rank(directory, local_error, "load_checkpoint", process_group)
    try:
        dcp_load(
            state_dict,
            storage_reader=FileSystemReader(directory),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:  # a BaseException: callers' ``except Exception`` miss it
        raise CheckpointError(_failures("load_checkpoint: reading", directory, exc)) from exc
    return info


def _failures(what: str, path: Path, exc: CheckpointException) -> str:
    """DCP's per-rank failures, identical ones merged: ``rank 0, 1: ValueError: ...``."""
    by_message: dict[str, list[int]] = {}
    for rank, (error, _) in sorted(exc.failures.items()):
        by_message.setdefault(f"{type(error).__name__}: {error}", []).append(rank)
    lines = [f"  ranks {ranks}: {message}" for message, ranks in by_message.items()]
    return f"{what} {str(path)!r} failed:\n" + "\n".join(lines)
