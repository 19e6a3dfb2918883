"""``AdamW8bit``'s boundary absmax exchange, for shards that cut a quantization block (see
``adamw8bit``'s note on such shards): the plan, made once per layout, and the step's one
all-gather per process group."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from optim_blockwise._private import quant
from optim_blockwise._private.adamw8bit_chunk import moments
from optim_blockwise._private.adamw8bit_places import Item
from optim_blockwise._private.agree import check_agreement, fingerprint
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.presence import PresenceFlags, check_presence, presence_status
from optim_blockwise._private.runs import local_of

__all__ = ["boundary_partials", "cuts_blocks", "exchange_boundaries", "plan_boundaries"]


def cuts_blocks(layout: ParamLayout, block: int) -> bool:
    return any(lo % block for lo, hi in layout.ranges if hi > lo)


def plan_boundaries(
    params: list[tuple[str, torch.Tensor, ParamLayout]], block: int, min_8bit_size: int
) -> dict[dist.ProcessGroup, list[tuple[torch.Tensor, str, ParamLayout]]]:
    """The boundary exchange (module note): every 8-bit parameter whose shards cut
    quantization blocks, per process group, and the ranks' agreement on it."""
    by_group: dict[dist.ProcessGroup, list[tuple[torch.Tensor, str, ParamLayout]]] = {}
    for name, param, layout in params:
        if layout.numel >= min_8bit_size and layout.is_sharded and cuts_blocks(layout, block):
            assert layout.group is not None
            by_group.setdefault(layout.group, []).append((param, name, layout))
    for group, members in by_group.items():
        check_agreement(
            group,
            fingerprint([(layout.global_shape, layout.ranges) for _, _, layout in members]),
            len(members),
            local_of(members[0][0]).device,
            "AdamW8bit",
            [name for _, name, _ in members],
        )
    return by_group


def boundary_partials(item: Item, state: dict[str, Any], block: int) -> torch.Tensor:
    """[m_head, v_head, m_tail, v_tail]: this rank's partial absmaxes of its edge blocks."""
    layout = item.layout
    n, start = layout.local_numel, layout.start
    device = state["exp_avg_absmax"].device
    if n == 0:
        return torch.zeros(4, dtype=torch.float32, device=device)
    beta1, beta2 = item.group["betas"]
    grad = item.param.grad
    assert grad is not None
    g = local_flat(grad, item.name).float()
    out = []
    tail_lo = max(((layout.stop - 1) // block) * block - start, 0)
    for lo, hi, b in ((0, min(n, block - start % block), 0), (tail_lo, n, -1)):
        edge = []
        for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
            code, _ = quant._map_and_midpoints(signed, device)
            edge.append(code[state[f"{key}_codes"][lo:hi].long()] * state[f"{key}_absmax"][b])
        moments(edge[0], edge[1], g[lo:hi], beta1, beta2)
        out += [edge[0].abs().amax(), edge[1].abs().amax()]
    return torch.stack(out)


def exchange_boundaries(
    boundaries: dict[dist.ProcessGroup, list[tuple[torch.Tensor, str, ParamLayout]]],
    items: list[Item],
    states: list[dict[str, Any]],
    block: int,
    presence: PresenceFlags,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Global absmax of each exchanged item's first and last local block (m and v): one
    all-gather per process group of every planned parameter's partials and presence."""
    index = {item.param: i for i, item in enumerate(items)}
    result: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for group, members in boundaries.items():
        device = local_of(members[0][0]).device
        present = [param in index for param, _, _ in members]
        absent = torch.zeros(4, dtype=torch.float32, device=device)
        parts = [
            boundary_partials(items[index[param]], states[index[param]], block)
            if param in index
            else absent
            for param, _, _ in members
        ]
        n = len(members)
        flags = presence(present, n, torch.float32, device)
        mine = torch.cat([*parts, flags])
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        table = torch.stack(gathered)
        check_presence(
            presence_status(table[:, 4 * n :].sum(0), world),
            range(n),
            "AdamW8bit",
            [name for _, name, _ in members].__getitem__,
        )
        partials = table[:, : 4 * n].view(world, n, 4)
        for j, (param, _, layout) in enumerate(members):
            i = index.get(param)
            if i is None or layout.local_numel == 0:
                continue  # no gradient (on every rank), or nothing to quantize here
            head_block = layout.start // block
            tail_block = (layout.stop - 1) // block
            # Global absmax of a block = max of every rank's partial max over that block.
            edges = []
            for target in (head_block, tail_block):
                edge_parts = []
                for k, (lo, hi) in enumerate(layout.ranges):
                    if hi <= lo:
                        continue
                    if lo // block == target:
                        edge_parts.append(partials[k, j, 0:2])
                    if (hi - 1) // block == target:
                        edge_parts.append(partials[k, j, 2:4])
                edges.append(torch.stack(edge_parts).amax(dim=0))
            result[i] = (edges[0], edges[1])
    return result
