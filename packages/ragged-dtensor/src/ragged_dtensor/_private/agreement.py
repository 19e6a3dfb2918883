"""One mechanism for "do all ranks hold the same record?", used before any sized collective.

[Note: agreeing before communicating]
When ranks pass self-consistent but mutually different sizes to a collective, gloo aborts the
process (SIGABRT) and NCCL hangs; when they pass equal sizes but mean different things (another
layout, another setting), the result is silently wrong. So every package compares a small
record (a ``str -> str`` mapping: settings, layout fingerprints, paths, per-rank outcomes) across
the ranks first, and raises on every rank when they differ.

The comparison costs one fixed-size all-gather per mesh axis in the common case: each rank
contributes the SHA-256 of its record's canonical JSON (32 bytes, the same size everywhere, so
the collective itself can never mismatch). Only when the digests differ does a second exchange
move the records themselves (an object all-gather, which sends each object's length first), so
that the error can name every key that differs and the ranks on each side. Every rank receives
the same digests and the same records, so every rank takes the same branch, issues the same
collectives and raises the same error: nobody is left waiting.

Gathering along each mesh axis in turn spreads every rank's value to every rank of the mesh
(after the last axis, the gathered values of the earlier axes travel along), so a 2-D mesh needs
no flattened process group.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "RanksDisagreeError",
    "check_ranks_agree",
    "describe_disagreement",
    "gather_records_if_different",
    "record_digest",
]

Where = DeviceMesh | dist.ProcessGroup | None
_DIGEST_WORDS = 4  # 32 bytes of SHA-256 as int64 words


class RanksDisagreeError(ValueError):
    """Ranks that must hold the same record (settings, layout, placements) do not."""


def record_digest(record: Mapping[str, str]) -> bytes:
    """SHA-256 of the record's canonical JSON (sorted keys): equal iff the records are equal."""
    text = json.dumps({str(k): str(v) for k, v in record.items()}, sort_keys=True)
    return hashlib.sha256(text.encode()).digest()


def _groups(where: Where) -> list[dist.ProcessGroup]:
    """The process groups to gather along, innermost mesh axis first (size-1 axes skipped)."""
    if not dist.is_initialized():
        return []
    if isinstance(where, DeviceMesh):
        groups = [where.get_group(axis) for axis in reversed(range(where.ndim))]
    else:
        groups = [where if where is not None else dist.group.WORLD]  # type: ignore[list-item]
    return [g for g in groups if dist.get_world_size(g) > 1]


def _device(group: dist.ProcessGroup) -> torch.device:
    # the device the backend moves small host objects on (cpu for gloo, the current GPU for nccl)
    return torch.device(dist.distributed_c10d._get_object_coll_device(group))


def _digests_agree(groups: list[dist.ProcessGroup], digest: bytes) -> bool:
    words = torch.frombuffer(bytearray(digest), dtype=torch.int64)
    value = words
    for group in groups:
        value = value.to(_device(group))
        gathered = value.new_empty(dist.get_world_size(group) * value.numel())
        dist.all_gather_single(gathered, value.contiguous(), group=group)
        value = gathered
    table = value.cpu().view(-1, _DIGEST_WORDS)
    return bool((table == table[0]).all())


def _flatten(value: Any) -> list[tuple[int, dict[str, str]]]:
    if isinstance(value, list):
        return [item for part in value for item in _flatten(part)]
    rank, record = value
    return [(int(rank), dict(record))]


def gather_records_if_different(
    where: Where, record: Mapping[str, str]
) -> list[tuple[int, dict[str, str]]] | None:
    """``None`` when every rank of ``where`` holds ``record``; else every rank's
    ``(global rank, record)``, sorted by rank, identically on every rank.

    Collective over ``where`` (a mesh: every axis; a process group; ``None``: the world). One
    32-byte all-gather per mesh axis when the records agree; one object all-gather per axis more
    when they do not. Without a process group (or on one rank) it returns ``None`` at once.
    """
    mine = {str(k): str(v) for k, v in record.items()}
    groups = _groups(where)
    if not groups or _digests_agree(groups, record_digest(mine)):
        return None
    value: Any = (dist.get_rank(), mine)
    for group in groups:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, value, group=group)
        value = gathered
    return sorted(_flatten(value), key=lambda item: item[0])


def describe_disagreement(records: list[tuple[int, dict[str, str]]]) -> list[str]:
    """One line per differing key: ``key: ranks [0, 1] have 'a', ranks [2] have 'b'``.

    Ranks are grouped by the value they hold for that key (a missing key shows as ``None``), in
    order of the lowest rank holding each value, so every rank words it identically.
    """
    keys = sorted({key for _, rec in records for key in rec})
    lines = []
    for key in keys:
        by_value: dict[str | None, list[int]] = {}
        for rank, rec in records:
            by_value.setdefault(rec.get(key), []).append(rank)
        if len(by_value) > 1:
            sides = ", ".join(f"ranks {ranks} have {value!r}" for value, ranks in by_value.items())
            lines.append(f"  {key}: {sides}")
    return lines


def check_ranks_agree(
    where: Where,
    record: Mapping[str, str],
    *,
    what: str,
    error: Callable[[str], Exception] = RanksDisagreeError,
) -> None:
    """Raise ``error`` on every rank of ``where`` unless all ranks hold ``record``.

    The message starts with ``what`` (who is checking, and what the record describes) and lists
    every key that differs with the ranks on each side (global ranks). Collective; see
    ``gather_records_if_different`` for its cost.
    """
    records = gather_records_if_different(where, record)
    if records is None:
        return
    raise error("\n".join([what, *describe_disagreement(records)]))
