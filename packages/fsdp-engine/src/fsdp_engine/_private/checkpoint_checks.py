"""What every rank checks, and agrees on, before a save or load touches DCP.

[Note: per-rank plain tensors]
DCP treats a plain (non-DTensor) tensor as replicated: it keeps one rank's copy (deduplication)
and hands that copy to every rank on load. A plain tensor that differs between ranks, e.g. the
local shard of an optimizer state kept outside a DTensor, would be silently lost on every rank
but one. Before writing anything the save compares a digest of every plain tensor across ranks
and refuses (naming the key and the ranks) when they differ.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_engine._private.checkpoint_common import describe, shown
from fsdp_engine._private.checkpoint_errors import CheckpointError
from ragged_dtensor import gather_records_if_different

__all__ = ["check_every_rank", "check_replicated", "check_state_dict"]


def _tensors(value: Any, prefix: str, plain_only: bool) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, DTensor) and plain_only:
        return
    if isinstance(value, torch.Tensor):
        yield prefix, value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _tensors(item, f"{prefix}.{key}" if prefix else str(key), plain_only)
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _tensors(item, f"{prefix}.{index}", plain_only)


def _tensor_digest(tensor: torch.Tensor) -> str:
    """Shape, dtype and SHA-256 of the bytes: equal on every rank iff the tensor is replicated."""
    flat = tensor.detach().reshape(-1).cpu().contiguous()
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{tuple(tensor.shape)}/{tensor.dtype}/{hashlib.sha256(data).hexdigest()[:32]}"


def check_replicated(
    state_dict: Mapping[str, Any], group: dist.ProcessGroup | None, op: str = "save_checkpoint"
) -> None:
    """Refuse plain tensors that differ between ranks (see [Note: per-rank plain tensors])."""
    mine = {key: _tensor_digest(t) for key, t in _tensors(state_dict, "", plain_only=True)}
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
        f"{op}: these plain (non-DTensor) tensors differ between ranks. DCP "
        "treats a plain tensor as replicated and would keep only one rank's copy, so the "
        "others' data would be silently lost (per-rank state must be a DTensor, e.g. a "
        "RaggedShard with its parameter's placement):\n" + "\n".join(problems)
    )


def check_state_dict(state_dict: Any, op: str) -> Exception | None:
    """A dict, and no tensor without data (meta): DCP would fail deep inside, unnamed."""
    if not isinstance(state_dict, dict):
        return TypeError(f"{op}: state_dict must be a dict, got {type(state_dict).__name__}")
    meta = [
        key
        for key, tensor in _tensors(state_dict, "", plain_only=False)
        if (tensor._local_tensor if isinstance(tensor, DTensor) else tensor).is_meta
    ]
    if meta:
        return CheckpointError(
            f"{op}: {shown(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device (no "
            f"data): materialize the model first (to_empty(device=...) and initialize or load)"
        )
    return None


def check_every_rank(
    path: Path, error: Exception | None, op: str, group: dist.ProcessGroup | None
) -> None:
    """Before any collective of DCP: every rank names the same path and none failed its local
    check, else every rank raises (a rank raising alone would leave the others waiting in
    DCP's collectives until the timeout; ranks writing to different paths would commit a
    checkpoint missing the others' files). The shared agreement check: one small all-gather."""
    record = {"path": os.path.abspath(path), "error": "" if error is None else describe(error)}
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
