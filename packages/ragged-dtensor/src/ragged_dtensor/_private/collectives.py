"""Free functions for the collectives of ragged layouts: one collective each, uneven shares
padded.

[Note: padding uneven shares]
gloo rejects an all-gather whose per-rank sizes differ, and NCCL's all-gather wants equal sizes too,
so an uneven share is padded to the largest one: the collective moves ``m * max_share`` elements.
When the shares are even (the common case with a planned layout) nothing is padded and nothing is
copied: the local tensor is sent as is and the gathered buffer *is* the result. A ragged -> ragged
change uses one all-to-all with uneven splits instead, which every backend accepts and which moves
each element at most once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ragged_dtensor._private.geometry import FlatRange

__all__ = ["all_gather_flat", "all_to_all_flat", "reduce_scatter_flat", "reduce_op"]


def reduce_op(name: str) -> dist.ReduceOp.RedOpType:
    """The c10d reduction for a Partial's reduce_op name (avg is done as sum, then divided)."""
    table = {
        "sum": dist.ReduceOp.SUM,
        "avg": dist.ReduceOp.SUM,
        "max": dist.ReduceOp.MAX,
        "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT,
    }
    if name not in table:
        raise ValueError(
            f"Partial({name!r}) cannot be reduce-scattered into a RaggedShard: "
            f"expected one of {sorted(table)}"
        )
    return table[name]


def all_gather_flat(
    local: torch.Tensor,
    ranges: Sequence[FlatRange],
    group: ProcessGroup,
) -> torch.Tensor:
    """Gather each rank's flat ``ranges[k]`` share into one flat tensor (one all-gather).

    ``local`` is this rank's share (1-D, contiguous). Returns the concatenation of all shares in
    rank order, of ``ranges[-1].stop - ranges[0].start`` elements.
    """
    world = len(ranges)
    sizes = [r.numel for r in ranges]
    share = max(sizes)
    send = local.reshape(-1)
    if send.numel() != share:
        padded = send.new_zeros(share)
        padded[: send.numel()].copy_(send)
        send = padded
    gathered = send.new_empty(world * share)
    dist.all_gather_single(gathered, send.contiguous(), group=group)
    if all(s == share for s in sizes):
        return gathered
    pieces = [gathered[k * share : k * share + sizes[k]] for k in range(world)]
    return torch.cat(pieces)


def reduce_scatter_flat(
    full: torch.Tensor, ranges: Sequence[FlatRange], rank: int, op: str, group: ProcessGroup
) -> torch.Tensor:
    """Reduce ``full`` (same shape on every rank) and keep this rank's ``ranges[rank]``.

    One reduce-scatter. ``op`` is the Partial's reduce_op; "avg" divides the sum by the group size.
    """
    world = len(ranges)
    sizes = [r.numel for r in ranges]
    share = max(sizes)
    flat = full.reshape(-1)
    if all(s == share for s in sizes) and ranges[0].start == 0 and flat.numel() == world * share:
        send = flat.contiguous()
    else:
        send = flat.new_zeros(world * share)
        for k, r in enumerate(ranges):
            send[k * share : k * share + r.numel].copy_(flat[r.start : r.stop])
    out = flat.new_empty(share)
    dist.reduce_scatter_single(out, send, op=reduce_op(op), group=group)
    result = out[: sizes[rank]]
    if op == "avg":
        result = result / world
    return result


def all_to_all_flat(
    local: torch.Tensor,
    src: Sequence[FlatRange],
    dst: Sequence[FlatRange],
    rank: int,
    group: ProcessGroup,
) -> torch.Tensor:
    """Move from the ``src`` split to the ``dst`` split of the same flat tensor (one all-to-all).

    Rank ``i`` sends rank ``j`` the intersection of ``src[i]`` and ``dst[j]``: a contiguous piece of
    its local share. What rank ``j`` receives, in rank order, is exactly its ``dst[j]`` share.
    """
    mine_src, mine_dst = src[rank], dst[rank]
    send_sizes = [_overlap(mine_src, d) for d in dst]
    recv_sizes = [_overlap(s, mine_dst) for s in src]
    out = local.new_empty(mine_dst.numel)
    dist.all_to_all_single(
        out,
        local.reshape(-1).contiguous(),
        output_split_sizes=recv_sizes,
        input_split_sizes=send_sizes,
        group=group,
    )
    return out


def _overlap(a: FlatRange, b: FlatRange) -> int:
    return max(0, min(a.stop, b.stop) - max(a.start, b.start))
