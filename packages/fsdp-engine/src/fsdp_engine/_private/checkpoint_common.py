"""What every checkpoint module shares: the names on disk, durable writes, rank-0 decisions.

A checkpoint is a directory written by DCP plus our ``COMMITTED`` marker; its parent holds the
``latest`` pointer and, while a save runs, the hidden ``.<name>.partial`` directory (see
[Note: commit protocol] in ``checkpoint_save``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

__all__ = [
    "COMMIT_MARKER",
    "DCP_METADATA",
    "FORMAT",
    "LATEST_POINTER",
    "describe",
    "failures",
    "fsync_dir",
    "on_rank0",
    "partial_path",
    "rank_of",
    "share_from_rank0",
    "shown",
    "world_of",
    "write_durably",
]

COMMIT_MARKER = "COMMITTED"
LATEST_POINTER = "latest"
DCP_METADATA = ".metadata"
FORMAT = 2  # 2: with the save identifier and per-range digests


def partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def rank_of(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def world_of(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, text: str) -> None:
    with path.open("w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def shown(keys: Sequence[str], limit: int = 8) -> str:
    text = ", ".join(repr(k) for k in keys[:limit])
    return text + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def share_from_rank0(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``value`` on every rank (one object broadcast; also the barrier of a phase)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    box: list[Any] = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def on_rank0(rank: int, action: Callable[[], Any]) -> tuple[str | None, Any]:
    """``(None, result)`` of ``action()`` on rank 0, ``(error text, None)`` if it raised;
    ``(None, None)`` elsewhere."""
    if rank != 0:
        return None, None
    try:
        return None, action()
    except Exception as exc:  # reported to every rank by the caller's broadcast
        return describe(exc), None


def failures(what: str, path: Path, exc: CheckpointException) -> str:
    """DCP's per-rank failures, identical ones merged: ``ranks [0, 1]: ValueError: ...``."""
    by_message: dict[str, list[int]] = {}
    for rank, (error, _) in sorted(exc.failures.items()):
        by_message.setdefault(describe(error), []).append(rank)
    lines = [f"  ranks {ranks}: {message}" for message, ranks in by_message.items()]
    return f"{what} {str(path)!r} failed:\n" + "\n".join(lines)
