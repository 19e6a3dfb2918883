"""Checking that every rank of a mesh built the same buffer, before any sized collective runs.

[Note: why agree before communicating]
If ranks pass self-consistent but mutually different sizes to a collective, gloo aborts the process
(SIGABRT) and NCCL hangs. So a DBuffer compares a small record (layout fingerprint, shard size,
dtype, shapes digest) across the whole mesh at construction with object all-gathers, which move
each record's length first and therefore never disagree on sizes. Every rank receives every
record, so every rank reaches the same verdict and raises the same error: nobody is left waiting.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

__all__ = ["LayoutMismatchError", "check_agreement"]


class LayoutMismatchError(ValueError):
    """Ranks of one mesh built different buffers (layouts, dtypes or shapes differ)."""


def _flatten(value: Any) -> list[tuple[int, dict[str, str]]]:
    if isinstance(value, list):
        return [item for part in value for item in _flatten(part)]
    rank, record = value
    return [(int(rank), dict(record))]


def gather_records(mesh: DeviceMesh, record: dict[str, str]) -> list[tuple[int, dict[str, str]]]:
    """Every rank's ``(global rank, record)``, on every rank of ``mesh`` (one object all-gather per
    mesh axis: gathering along each axis in turn spreads every record to every rank)."""
    value: Any = (dist.get_rank(), record)
    for axis in reversed(range(mesh.ndim)):
        group = mesh.get_group(axis)
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, value, group=group)
        value = gathered
    return sorted(_flatten(value))


def check_agreement(mesh: DeviceMesh, record: dict[str, str], *, what: str = "DBuffer") -> None:
    """Raise ``LayoutMismatchError`` on every rank unless all ranks of ``mesh`` hold ``record``."""
    records = gather_records(mesh, record)
    distinct: list[dict[str, str]] = []
    for _, rec in records:
        if rec not in distinct:
            distinct.append(rec)
    if len(distinct) == 1:
        return
    reference = distinct[0]
    ref_ranks = [r for r, rec in records if rec == reference]
    lines = [
        f"{what}: the ranks of the mesh built different buffers (compared at construction, "
        f"before any collective)"
    ]
    for other in distinct[1:]:
        ranks = [r for r, rec in records if rec == other]
        for key in sorted(set(reference) | set(other)):
            if reference.get(key) != other.get(key):
                lines.append(
                    f"  {key}: ranks {ref_ranks} have {reference.get(key)!r}, "
                    f"ranks {ranks} have {other.get(key)!r}"
                )
    raise LayoutMismatchError("\n".join(lines))
