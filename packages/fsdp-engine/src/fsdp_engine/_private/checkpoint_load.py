"""Loading a committed checkpoint: checked before any rank reads data, verified as it reads.

[Note: strict loading]
DCP ignores checkpoint keys the target state dict lacks (a 3-layer checkpoint loads into a
2-layer model) and casts values to the target's dtype. ``load_checkpoint`` compares the
flattened keys (DCP's own flattening), global shapes and dtypes of the target with the
checkpoint's metadata first and raises naming every key that differs; ``strict=False`` allows
the subset cases (keys missing on either side), never a shape or dtype change.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from fsdp_engine._private import checkpoint_files
from fsdp_engine._private.checkpoint_checks import check_every_rank, check_state_dict
from fsdp_engine._private.checkpoint_common import DCP_METADATA, FORMAT, failures, shown
from fsdp_engine._private.checkpoint_discovery import checkpoint_info
from fsdp_engine._private.checkpoint_errors import CheckpointError, CheckpointIntegrityError

__all__ = ["load_checkpoint", "verify_checkpoint"]


def _read_metadata(directory: Path, info: Mapping[str, Any], verify: bool) -> Metadata:
    """DCP's ``.metadata``, checked against the marker (digest, save identifier) if ``verify``."""
    path = directory / DCP_METADATA
    data = path.read_bytes()
    save_id = str(info.get("save_id"))
    if verify:
        if info.get("format") != FORMAT or not isinstance(info.get("files"), dict):
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
        lines.append(f"  missing from the checkpoint ({len(missing)}): {shown(missing)}")
    if strict and extra:
        lines.append(f"  in the checkpoint, not in the state dict ({len(extra)}): {shown(extra)}")
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
    local_error: Exception | None = check_state_dict(state_dict, "load_checkpoint")
    try:
        info = checkpoint_info(directory)
        metadata = _read_metadata(directory, info, verify)
        if local_error is None:
            local_error = _compare_keys(state_dict, metadata, directory, strict)
    except (CheckpointError, OSError, ValueError, pickle.UnpicklingError, EOFError) as exc:
        local_error = local_error or exc
    check_every_rank(directory, local_error, "load_checkpoint", process_group)
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
        raise error(failures("load_checkpoint: reading", directory, exc)) from exc
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
