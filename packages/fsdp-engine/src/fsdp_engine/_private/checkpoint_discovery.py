"""Finding checkpoints: the commit marker, its record, and the checkpoint to resume from."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

from fsdp_engine._private.checkpoint_common import COMMIT_MARKER, LATEST_POINTER, describe
from fsdp_engine._private.checkpoint_errors import (
    CheckpointError,
    CheckpointIntegrityError,
    IncompleteCheckpointError,
)

__all__ = ["checkpoint_info", "is_complete_checkpoint", "latest_checkpoint"]


def is_complete_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a committed checkpoint directory (has the ``COMMITTED`` marker)."""
    return (Path(path) / COMMIT_MARKER).is_file()


def checkpoint_info(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The marker record of a committed checkpoint: ``save_id``, ``time`` (of the commit),
    ``world_size``, ``metadata`` and ``files`` (each file's size and digests).

    Raises ``IncompleteCheckpointError`` for a directory without the marker and
    ``CheckpointIntegrityError`` for a marker that is not a valid record, naming the path.
    """
    directory = Path(path)
    if not is_complete_checkpoint(directory):
        raise IncompleteCheckpointError(_incomplete_message(directory))
    marker = directory / COMMIT_MARKER
    try:
        info = json.loads(marker.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointIntegrityError(
            f"{str(marker)!r} is not a valid {COMMIT_MARKER} marker ({describe(exc)}): the "
            f"checkpoint cannot be trusted"
        ) from exc
    expected = {"format": int, "world_size": int, "time": float, "metadata": dict}
    for field, kind in expected.items():
        value = info.get(field) if isinstance(info, dict) else None
        if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
            raise CheckpointIntegrityError(
                f"{str(marker)!r} is not a valid {COMMIT_MARKER} marker: field {field!r} is "
                f"{value!r}, expected a {kind.__name__}"
            )
    result: dict[str, Any] = info
    return result


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


def _inside(base: Path, name: str) -> bool:
    """``name`` is a visible entry of ``base`` that stays inside it (no separators, no ``..``,
    not hidden or partial, no symbolic link leading elsewhere)."""
    return (
        bool(name)
        and Path(name).name == name
        and name not in (".", "..")
        and not name.startswith(".")
        and (base / name).resolve().parent == base.resolve()
    )


def _pointer_target(base: Path) -> Path | None:
    """The directory ``base/latest`` names, if it is a committed checkpoint directly inside
    ``base``; else ``None`` (with a warning naming the pointer, when there is one)."""
    pointer = base / LATEST_POINTER
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        warnings.warn(f"latest_checkpoint: cannot read {str(pointer)!r} ({exc})", stacklevel=3)
        return None
    target = base / name
    if not _inside(base, name):
        problem = f"names {name!r}, which is not a directory inside {str(base)!r}"
    elif not is_complete_checkpoint(target):
        problem = f"names {name!r}, which is not a committed checkpoint"
    else:
        return target
    warnings.warn(
        f"latest_checkpoint: {str(pointer)!r} {problem}; using the newest committed "
        f"checkpoint by commit time instead",
        stacklevel=3,
    )
    return None


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The checkpoint to resume from under ``root``, or ``None``.

    ``root/latest`` when it names a committed checkpoint directly inside ``root`` (saves point
    it at each new checkpoint; a user may point it back at a known-good one). Otherwise the
    committed checkpoint with the newest commit time (recorded in its marker), never decided
    by name; directories whose marker cannot be read are skipped with a warning naming them.
    Partial directories are never returned; neither is a checkpoint an asynchronous save is
    still writing (it is partial until its commit).
    """
    base = Path(root)
    if not base.is_dir():
        return None
    target = _pointer_target(base)
    if target is not None:
        return target
    newest: tuple[float, str] | None = None
    for child in base.iterdir():
        if not _inside(base, child.name) or not child.is_dir():
            continue
        if not is_complete_checkpoint(child):
            continue
        try:
            stamp = float(checkpoint_info(child)["time"])
        except CheckpointError as exc:
            warnings.warn(f"latest_checkpoint: skipping {exc}", stacklevel=2)
            continue
        if newest is None or (stamp, child.name) > newest:
            newest = (stamp, child.name)
    return None if newest is None else base / newest[1]
