"""Detect ranks that disagree on what they are about to exchange, before the exchange.

gloo aborts the process (SIGABRT) when ranks pass self-consistent but mutually different sizes to
a collective, and NCCL hangs. Every batched exchange of this package is therefore preceded by the
agreement check every package shares (``ragged_dtensor.check_ranks_agree``: a fixed-size digest
all-gather, the records only when they differ) on a fingerprint of its layout, and a mismatch
raises on every rank.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from ragged_dtensor import check_ranks_agree

__all__ = ["fingerprint", "check_agreement"]


def fingerprint(description: object) -> int:
    """A stable 31-bit digest of ``repr(description)``."""
    return zlib.crc32(repr(description).encode()) & 0x7FFFFFFF


def check_agreement(
    group: dist.ProcessGroup,
    digest: int,
    count: int,
    device: torch.device,
    what: str,
    names: list[str],
) -> None:
    """Raise ``RuntimeError`` on every rank unless all ranks pass the same ``(digest, count)``.

    ``device`` is unused: the shared check picks the group's own device for its digest."""
    del device
    check_ranks_agree(
        group,
        {"exchange fingerprint": str(digest), "number of tensors": str(count)},
        what=(
            f"{what}: ranks of a process group disagree on the tensors to exchange this step; "
            f"every rank must step the same parameters with gradients (this rank: {names})"
        ),
        error=RuntimeError,
    )
