"""Detect ranks that disagree on what they are about to exchange, before the exchange.

gloo aborts the process (SIGABRT) when ranks pass self-consistent but mutually different sizes to
a collective, and NCCL hangs. Every batched exchange of this package is therefore preceded by a
fixed-size all-gather of a fingerprint of its layout, and a mismatch raises on every rank.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

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
    """Raise ``RuntimeError`` on every rank unless all ranks pass the same ``(digest, count)``."""
    world = dist.get_world_size(group)
    mine = torch.tensor([digest, count], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    values = [tuple(int(v) for v in t.tolist()) for t in gathered]
    if any(v != values[0] for v in values):
        raise RuntimeError(
            f"{what}: ranks of a process group disagree on the tensors to exchange this step "
            f"((fingerprint, count) per rank: {values}); every rank must step the same "
            f"parameters with gradients (this rank: {names})"
        )
