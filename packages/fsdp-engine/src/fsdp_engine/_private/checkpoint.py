"""Atomically committed, integrity-checked ``torch.distributed.checkpoint`` (DCP) checkpoints.

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

[Note: per-rank plain tensors]
DCP treats a plain (non-DTensor) tensor as replicated: it keeps one rank's copy (deduplication)
and hands that copy to every rank on load. A plain tensor that differs between ranks, e.g. the
local shard of an optimizer state kept outside a DTensor, would be silently lost on every rank
but one. Before writing anything the save compares a digest of every plain tensor across ranks
and refuses (naming the key and the ranks) when they differ.

[Note: strict loading]
DCP ignores checkpoint keys the target state dict lacks (a 3-layer checkpoint loads into a
2-layer model) and casts values to the target's dtype. ``load_checkpoint`` compares the
flattened keys (DCP's own flattening), global shapes and dtypes of the target with the
checkpoint's metadata first and raises naming every key that differs; ``strict=False`` allows
the subset cases (keys missing on either side), never a shape or dtype change.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import time
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from fsdp_engine._private import checkpoint_files
from fsdp_engine._private.checkpoint_errors import (
    AfterCommitError,
    CheckpointError,
    CheckpointIntegrityError,
    IncompleteCheckpointError,
)
from ragged_dtensor import gather_records_if_different

__all__ = [
    "COMMIT_MARKER",
    "AfterCommitError",
    "CheckpointError",
    "CheckpointIntegrityError",
    "IncompleteCheckpointError",
    "checkpoint_info",
    "is_complete_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]

COMMIT_MARKER = "COMMITTED"
LATEST_POINTER = "latest"
DCP_METADATA = ".metadata"
_FORMAT = 2  # 2: with the save identifier and per-range digests


# -- small helpers ---------------------------------------------------------------------------------


def _partial_path(path: Path) -> Path:
    return path.parent / f".{path.name}.partial"


def _rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def _world(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


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


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _share_from_rank0(value: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``value`` on every rank (one object broadcast; also the barrier of a phase)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return value
    box: list[Any] = [value]
    src = 0 if group is None else dist.get_global_rank(group, 0)
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _on_rank0(rank: int, action: Callable[[], Any]) -> tuple[str | None, Any]:
    """``(None, result)`` of ``action()`` on rank 0, ``(error text, None)`` if it raised;
    ``(None, None)`` elsewhere."""
    if rank != 0:
        return None, None
    try:
        return None, action()
    except Exception as exc:  # reported to every rank by the caller's broadcast
        return _describe(exc), None


# -- checks every rank agrees on ----------------------------------------------------------------


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


def _tensor_digest(tensor: torch.Tensor) -> str:
    """Shape, dtype and SHA-256 of the bytes: equal on every rank iff the tensor is replicated."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{tuple(tensor.shape)}/{tensor.dtype}/{hashlib.sha256(data).hexdigest()[:32]}"


def _check_replicated(state_dict: Mapping[str, Any], group: dist.ProcessGroup | None) -> None:
    """Refuse plain tensors that differ between ranks (DCP would keep only one rank's copy)."""
    mine = {key: _tensor_digest(t) for key, t in _plain_tensors(state_dict, "")}
    records = gather_records_if_different(group, mine)
    if records is None:
        return
    problems = []
    for key in sorted({k for _, rec in records for k in rec}):
        by_value: dict[str, list[int]] = {}
        for rank, rec in records:
            by_value.setdefault(rec.get(key, "missing"), []).append(rank)
        if len(by_value) > 1:
            detail = "; ".join(f"ranks {ranks}: {v}" for v, ranks in by_value.items())
            problems.append(f"  {key!r}: {detail}")
    raise CheckpointError(
        "save_checkpoint: these plain (non-DTensor) tensors differ between ranks. DCP "
        "treats a plain tensor as replicated and would keep only one rank's copy, so the "
        "others' data would be silently lost (per-rank state must be a DTensor, e.g. a "
        "RaggedShard with its parameter's placement):\n" + "\n".join(problems)
    )


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
        return CheckpointError(
            f"{op}: {_shown(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (no "
            f"data): materialize the model first (to_empty(device=...) and initialize or load)"
        )
    return None


def _shown(keys: Sequence[str], limit: int = 8) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def _check_every_rank(
    path: Path, error: Exception | None, op: str, group: dist.ProcessGroup | None
) -> None:
    """Before any collective of DCP: every rank names the same path and none failed its local
    check, else every rank raises (a rank raising alone would leave the others waiting in
    DCP's collectives until the timeout; ranks writing to different paths would commit a
    checkpoint missing the others' files). The shared agreement check: one small all-gather."""
    record = {"path": os.path.abspath(path), "error": "" if error is None else _describe(error)}
    records = gather_records_if_different(group, record)
    if records is None:
        if error is not None:
            raise error
        return
    paths: dict[str, list[int]] = {}
    errors: dict[str, list[int]] = {}
    for rank, rec in records:
        paths.setdefault(rec["path"], []).append(rank)
        if rec["error"]:
            errors.setdefault(rec["error"], []).append(rank)
    if len(paths) > 1:
        listed = "; ".join(f"ranks {ranks}: {where!r}" for where, ranks in paths.items())
        raise CheckpointError(f"{op}: the ranks were given different paths ({listed})")
    if error is not None:
        raise error
    listed = "; ".join(f"ranks {ranks}: {message}" for message, ranks in errors.items())
    raise CheckpointError(f"{op}: other ranks failed before starting ({listed})")


# -- save ------------------------------------------------------------------------------------------


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
    it. ``path`` must not exist yet. Returns ``path``.

    Raises ``CheckpointError`` on every rank when the save fails (nothing is committed and the
    partial directory is removed), ``AfterCommitError`` when the checkpoint was committed but a
    later step failed. ``check_replicated``: compare plain tensors across ranks first and raise
    naming any that differ (DCP would silently keep one rank's copy).
    """
    final = Path(path)
    partial = _partial_path(final)
    rank = _rank(process_group)
    local_error: Exception | None = _check_state_dict(state_dict, "save_checkpoint")
    if local_error is None and digest not in checkpoint_files.DIGESTS:
        local_error = ValueError(
            f"save_checkpoint: digest={digest!r}; expected one of {checkpoint_files.DIGESTS}"
        )
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
    failure, save_id = _share_from_rank0(_on_rank0(rank, lambda: _prepare(final)), process_group)
    if failure is not None:
        raise CheckpointError(
            f"save_checkpoint: preparing {str(final)!r} failed on rank 0 ({failure}); nothing "
            f"was written and earlier checkpoints are untouched"
        )
    writer = checkpoint_files.DigestingWriter(partial, save_id, digest)
    try:
        dcp_save(
            state_dict,
            storage_writer=writer,
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:  # a BaseException: callers' ``except Exception`` miss it
        # Every rank is past DCP's write step (DCP gathered its outcome): the directory is ours.
        cleanup = _share_from_rank0(_on_rank0(rank, lambda: _remove(partial))[0], process_group)
        raise CheckpointError(
            _failures("save_checkpoint: writing", final, exc)
            + f"\nNothing was committed; {_removal(partial, cleanup)}"
        ) from exc
    files = checkpoint_files.gather_digests(writer, process_group)
    record = {
        "format": _FORMAT,
        "save_id": save_id,
        "digest": digest,
        "world_size": _world(process_group),
        "metadata": dict(metadata or {}),
        "files": files,
    }
    failure, report = _share_from_rank0(
        _on_rank0(rank, lambda: _commit(partial, final, record)), process_group
    )
    if failure is not None:  # _commit reports its own failures; this is anything else
        raise CheckpointError(f"save_checkpoint: committing {str(final)!r} failed: {failure}")
    if report["error"] is not None:
        error = AfterCommitError if report["committed"] else CheckpointError
        raise error(report["error"])
    return final


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


def _commit(partial: Path, final: Path, record: dict[str, Any]) -> dict[str, Any]:
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
        _write_durably(partial / COMMIT_MARKER, json.dumps(record, sort_keys=True))
        step = "syncing the partial directory"
        _fsync_dir(partial)
        step = f"renaming {str(partial)!r} to {str(final)!r}"
        os.rename(partial, final)
    except Exception as exc:
        cleanup: str | None = None
        try:
            _remove(partial)
        except Exception as again:
            cleanup = _describe(again)
        return {
            "committed": False,
            "error": (
                f"save_checkpoint: committing {str(final)!r} failed on rank 0 while {step} "
                f"({_describe(exc)}); the checkpoint was NOT committed, "
                f"{_removal(partial, cleanup)}, and earlier checkpoints are untouched"
            ),
        }
    try:
        step = "syncing the parent directory"
        _fsync_dir(final.parent)
        step = f"updating the {LATEST_POINTER!r} pointer"
        pointer = final.parent / f".{LATEST_POINTER}.tmp"
        _write_durably(pointer, final.name)
        os.replace(pointer, final.parent / LATEST_POINTER)
        _fsync_dir(final.parent)
    except Exception as exc:
        return {"committed": True, "error": _after_commit(final, step, exc)}
    return {"committed": True, "error": None}


def _after_commit(final: Path, step: str, exc: Exception) -> str:
    head = (
        f"save_checkpoint: {str(final)!r} IS committed and loadable, but {step} failed on "
        f"rank 0 ({_describe(exc)})"
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
            f"({_describe(again)}): latest_checkpoint follows it until it is fixed"
        )
    return head + f"; latest_checkpoint finds {final.name!r} by commit time"


# -- reading the marker, finding the latest ---------------------------------------------------


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
            f"{str(marker)!r} is not a valid {COMMIT_MARKER} marker ({_describe(exc)}): the "
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
    Partial directories are never returned.
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


# -- load ------------------------------------------------------------------------------------------


def _read_metadata(directory: Path, info: Mapping[str, Any], verify: bool) -> Metadata:
    """DCP's ``.metadata``, checked against the marker (digest, save identifier) if ``verify``."""
    path = directory / DCP_METADATA
    data = path.read_bytes()
    save_id = str(info.get("save_id"))
    if verify:
        if info.get("format") != _FORMAT or not isinstance(info.get("files"), dict):
            raise CheckpointIntegrityError(
                f"{str(directory)!r} was committed without digests (format "
                f"{info.get('format')}); load it with verify=False"
            )
        record = info["files"].get(DCP_METADATA)
        expected = None if record is None else record["items"]
        actual = (
            None
            if record is None
            else checkpoint_files.file_record(path, [], checkpoint_files.algorithm_of(record))[
                "items"
            ]
        )
        if expected != actual:
            raise CheckpointIntegrityError(
                f"{str(path)!r} does not match the digest recorded when save {save_id} was "
                f"committed: it is damaged or comes from another save"
            )
    metadata = pickle.loads(data)
    if not isinstance(metadata, Metadata):
        raise CheckpointIntegrityError(f"{str(path)!r} is not DCP metadata")
    stored = getattr(metadata.storage_meta, "save_id", None)
    if verify and stored != save_id:
        raise CheckpointIntegrityError(
            f"{str(path)!r} belongs to save {stored}, but the marker is save {save_id}"
        )
    return metadata


def _flat_kinds(flat: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...], str]]:
    """``key -> (kind, global shape, dtype)`` of a flattened state dict (kind: tensor/object)."""
    out = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            out[key] = ("tensor", tuple(value.shape), str(value.dtype))
        else:
            out[key] = ("object", (), "")
    return out


def _metadata_kinds(metadata: Metadata) -> dict[str, tuple[str, tuple[int, ...], str]]:
    out = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            out[key] = ("tensor", tuple(entry.size), str(entry.properties.dtype))
        else:
            out[key] = ("object", (), "")
    return out


def _compare_keys(
    state_dict: dict[str, Any], metadata: Metadata, directory: Path, strict: bool
) -> CheckpointError | None:
    """What differs between the target state dict and the checkpoint (see [Note: strict
    loading]); ``None`` when the load may go ahead."""
    flat, _ = flatten_state_dict(state_dict)
    target = _flat_kinds(flat)
    saved = _metadata_kinds(metadata)
    lines = []
    missing = sorted(set(target) - set(saved))
    extra = sorted(set(saved) - set(target))
    if strict and missing:
        lines.append(f"  missing from the checkpoint ({len(missing)}): {_shown(missing)}")
    if strict and extra:
        lines.append(f"  in the checkpoint, not in the state dict ({len(extra)}): {_shown(extra)}")
    for key in sorted(set(target) & set(saved)):
        (kind, shape, dtype), (skind, sshape, sdtype) = target[key], saved[key]
        if kind != skind:
            lines.append(f"  {key!r}: the state dict holds a {kind}, the checkpoint a {skind}")
        elif shape != sshape:
            lines.append(f"  {key!r}: shape {shape} in the state dict, {sshape} in the checkpoint")
        elif dtype != sdtype:
            lines.append(f"  {key!r}: dtype {dtype} in the state dict, {sdtype} in the checkpoint")
    if not lines:
        return None
    hint = (
        " (strict=False loads the keys both have; shapes and dtypes must still match)"
        if strict
        else ""
    )
    return CheckpointError(
        f"load_checkpoint: the state dict does not match {str(directory)!r}{hint}:\n"
        + "\n".join(lines)
    )


def load_checkpoint(
    state_dict: dict[str, Any],
    path: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    strict: bool = True,
    verify: bool = True,
) -> dict[str, Any]:
    """Load the committed checkpoint ``path`` into ``state_dict`` in place (DCP, any world size).

    Collective. Before any rank reads data, every rank checks (and every rank raises if one
    fails): the ``COMMITTED`` marker (``IncompleteCheckpointError`` without it), the
    ``.metadata`` file against its digest and save identifier, and, with ``strict`` (default),
    that the state dict and the checkpoint have the same keys with the same global shapes and
    dtypes (``CheckpointError`` naming the keys; ``strict=False`` allows keys missing on either
    side). With ``verify`` (default), every byte range read is checked against its digest
    (``CheckpointIntegrityError`` naming the file and the ranks); ``verify=False`` skips the
    digests. Returns the marker record; then ``set_state_dict(model, optimizer, ...)`` applies
    the values.
    """
    directory = Path(path)
    info: dict[str, Any] = {}
    metadata: Metadata | None = None
    local_error: Exception | None = _check_state_dict(state_dict, "load_checkpoint")
    try:
        info = checkpoint_info(directory)
        metadata = _read_metadata(directory, info, verify)
        if local_error is None:
            local_error = _compare_keys(state_dict, metadata, directory, strict)
    except (CheckpointError, OSError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        local_error = local_error or exc
    _check_every_rank(directory, local_error, "load_checkpoint", process_group)
    assert metadata is not None
    files = info.get("files") if verify else None
    reader = checkpoint_files.VerifyingReader(directory, metadata, files, str(info.get("save_id")))
    try:
        dcp_load(
            state_dict,
            storage_reader=reader,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:  # a BaseException: callers' ``except Exception`` miss it
        damaged = any(isinstance(e, CheckpointIntegrityError) for e, _ in exc.failures.values())
        error = CheckpointIntegrityError if damaged else CheckpointError
        raise error(_failures("load_checkpoint: reading", directory, exc)) from exc
    return info


def verify_checkpoint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check every byte of the committed checkpoint ``path`` against its recorded digests (one
    process, no process group). Returns the marker record; raises
    ``CheckpointIntegrityError`` listing every file that does not match."""
    directory = Path(path)
    info = checkpoint_info(directory)
    _read_metadata(directory, info, verify=True)
    problems = []
    for name, record in sorted(info["files"].items()):
        file = directory / name
        if not file.is_file():
            problems.append(f"  {name!r}: missing")
            continue
        if file.stat().st_size != record["size"]:
            problems.append(f"  {name!r}: {file.stat().st_size} bytes, {record['size']} written")
            continue
        ranges = [(int(o), int(n)) for o, n, _ in record["items"]]
        if (
            checkpoint_files.file_record(file, ranges, checkpoint_files.algorithm_of(record))[
                "items"
            ]
            != record["items"]
        ):
            problems.append(f"  {name!r}: its bytes do not match the recorded digests")
    if problems:
        raise CheckpointIntegrityError(
            f"verify_checkpoint: {str(directory)!r} (save {info.get('save_id')}) has damaged "
            f"or foreign files:\n" + "\n".join(problems)
        )
    return info


def _failures(what: str, path: Path, exc: CheckpointException) -> str:
    """DCP's per-rank failures, identical ones merged: ``ranks [0, 1]: ValueError: ...``."""
    by_message: dict[str, list[int]] = {}
    for rank, (error, _) in sorted(exc.failures.items()):
        by_message.setdefault(_describe(error), []).append(rank)
    lines = [f"  ranks {ranks}: {message}" for message, ranks in by_message.items()]
    return f"{what} {str(path)!r} failed:\n" + "\n".join(lines)
