"""Muon's plan: the matrices ("units") to orthogonalize, their owners and the exchange buckets.

[Note: units]
A 2-D parameter is one unit. A 3-D parameter ``(E, m, n)`` is a stack of ``E`` expert matrices
(MoE weights), each orthogonalized on its own (its own norm) with its own learning-rate scale,
as if the experts were ``E`` separate 2-D parameters. Its units are *groups* of ``g``
consecutive experts, orthogonalized as one batched NS ``(g, m, n)`` on their owner, and the
groups of one parameter are spread over owners like any other units. ``g`` depends on the expert
shape only (about ``expert_group_flops`` of NS per group, at most ``E``), never on the world size or
on which rank owns what, so every world size, one device included, batches exactly the same
matrices together: a batched GEMM's result for one matrix may depend on what else is in the
batch on some backends, never on anything else. Group ``j`` is the global flat range
``[j g m n, min(E, (j + 1) g) m n)``; rank ``k`` holding ``[a_k, b_k)`` of the parameter holds
that range clamped to it, a tiling of the unit because the parameter's ranges tile the
parameter.

[Note: when the plan is made, and agreement]
The plan depends only on the parameters of the Muon path, their global shapes and layouts, and
the group settings that change costs (``ns_steps``, ``ns_dtype``): never on which gradients are
present in a step (absent ones travel as zeros, with presence flags, see ``exchange``). It is
made on the first step, cached under a key of exactly those inputs, and made again only when
they change (a new param group, a parameter frozen or unfrozen, another dtype). Only then do the
ranks check, with one small all-gather of a fingerprint per process group, that they planned
the same exchange: a steady-state step has no agreement collective and reads nothing from the
device.

Owners balance two costs (``owners.assign_owners``): Newton-Schulz flops and the bytes a root
holds while orthogonalizing (``ns_root_bytes``). Buckets hold about ``bucket_cap_mb`` of
payload each (at least one, at most as many as the largest number of units a rank owns).
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
import torch.distributed as dist

from optim_blockwise._private import exchange
from optim_blockwise._private.layout import ParamLayout
from optim_blockwise._private.newton_schulz import ns_flops, ns_root_bytes
from optim_blockwise._private.owners import assign_owners

__all__ = [
    "GroupPlan",
    "MuonItem",
    "Unit",
    "expert_group",
    "make_units",
    "on_muon_path",
    "plan_group",
    "plan_groups",
]


@attrs.frozen(eq=False)
class MuonItem:
    """One parameter on the Muon path."""

    param: torch.Tensor
    name: str
    group: dict[str, Any]
    layout: ParamLayout


@attrs.frozen
class Unit:
    """Matrices to orthogonalize together: parameter ``item`` (index into the plan's items),
    experts ``[expert, expert + count)`` of it (``batched`` for a 3-D parameter; a 2-D
    parameter is one unbatched matrix)."""

    item: int
    expert: int
    count: int
    batched: bool
    shape: tuple[int, int]
    """One matrix's shape."""
    local: tuple[int, int]
    """``[lo, hi)`` of this rank's local flat parameter that holds its piece of the unit."""
    ranges: tuple[tuple[int, int], ...]
    """The unit's own flat range held by every rank of the axis."""

    @property
    def numel(self) -> int:
        return self.count * self.shape[0] * self.shape[1]

    @property
    def view_shape(self) -> tuple[int, ...]:
        return (self.count, *self.shape) if self.batched else self.shape


def expert_group(shape: tuple[int, int], experts: int, steps: int, flops: int) -> int:
    """Experts per batched unit of a 3-D parameter: about ``flops`` of NS (at least 1, at most
    ``experts``); a function of the shape and settings alone (see the units note)."""
    return max(1, min(experts, flops // max(ns_flops(shape, steps), 1)))


@attrs.frozen(eq=False)
class GroupPlan:
    """The units of one (process group, NS dtype) and, when sharded, their exchange."""

    items: tuple[MuonItem, ...]
    units: tuple[Unit, ...]
    group: dist.ProcessGroup | None
    dtype: torch.dtype
    exchange: exchange.OwnerExchange | None
    """``None`` for unsharded parameters: each rank orthogonalizes them itself."""


def make_units(items: tuple[MuonItem, ...], group_flops: int) -> tuple[Unit, ...]:
    """The units of ``items`` (see the note), in parameter order then expert order."""
    units = []
    for index, item in enumerate(items):
        shape = item.layout.global_shape
        batched = len(shape) == 3
        experts, m, n = shape if batched else (1, *shape)
        steps = item.group["ns_steps"]
        group = expert_group((m, n), experts, steps, group_flops) if batched else 1
        a, b = item.layout.start, item.layout.stop
        for e in range(0, experts, group):
            count = min(group, experts - e)
            base, size = e * m * n, count * m * n
            ranges = tuple(
                (min(max(lo - base, 0), size), min(max(hi - base, 0), size))
                for lo, hi in item.layout.ranges
            )
            lo, hi = max(a, base) - a, min(b, base + size) - a
            local = (lo, hi) if hi > lo else (0, 0)
            units.append(Unit(index, e, count, batched, (m, n), local, ranges))
    return tuple(units)


def plan_group(
    items: tuple[MuonItem, ...],
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
    *,
    bucket_cap_mb: float,
    expert_group_flops: int,
    check: bool,
) -> GroupPlan:
    """Units, owners and buckets for ``items`` sharded over ``group`` (``None``: unsharded);
    with ``check``, every rank of ``group`` must have made the same plan (one all-gather)."""
    units = make_units(items, expert_group_flops)
    if group is None:
        return GroupPlan(items, units, None, dtype, None)
    first = items[0].layout
    for item in items:
        if item.layout.world != first.world or item.layout.coord != first.coord:
            raise ValueError(
                f"parameter {item.name!r} ({item.layout.placement}) shares a process group "
                f"with {items[0].name!r} but has a different axis size/coordinate"
            )
    costs = [
        (
            u.count * ns_flops(u.shape, items[u.item].group["ns_steps"]),
            u.count * ns_root_bytes(u.shape, dtype.itemsize),
        )
        for u in units
    ]
    shares = [[hi - lo for lo, hi in u.ranges] for u in units]
    owners = assign_owners(costs, shares)

    def name(i: int) -> str:
        unit = units[i]
        name = items[unit.item].name
        return f"{name}[{unit.expert}:{unit.expert + unit.count}]" if unit.batched else name

    owner_exchange = exchange.plan_owner_exchange(
        group,
        first.coord,
        [u.ranges for u in units],
        owners,
        weights=[c[0] for c in costs],  # each owner's NS work spread evenly over the buckets
        dtype=dtype,
        device=_device_of(items[0].param),
        bucket_cap_mb=bucket_cap_mb,
        check=check,
        what="Muon",
        names=name,
        description=[
            (i.layout.global_shape, i.layout.ranges, str(dtype), i.group["ns_steps"]) for i in items
        ]
        + [bucket_cap_mb, expert_group_flops],
        tensors=[i.name for i in items],
        count=len(items),
    )
    return GroupPlan(items, units, group, dtype, owner_exchange)


def on_muon_path(group: dict[str, Any], param: torch.Tensor) -> bool:
    """``use_muon`` of the group, or (``None``) whether ``param`` is a matrix or a stack."""
    use = group["use_muon"]
    return param.dim() in (2, 3) if use is None else bool(use)


def plan_groups(
    by_key: dict[tuple[dist.ProcessGroup | None, torch.dtype], list[MuonItem]],
    *,
    bucket_cap_mb: float,
    expert_group_flops: int,
    check: bool,
) -> list[GroupPlan]:
    """One ``plan_group`` per process group and NS dtype, in the order of ``by_key``."""
    return [
        plan_group(
            tuple(items),
            pg,
            dtype,
            bucket_cap_mb=bucket_cap_mb,
            expert_group_flops=expert_group_flops,
            check=check,
        )
        for (pg, dtype), items in by_key.items()
    ]


def _device_of(param: torch.Tensor) -> torch.device:
    from torch.distributed.tensor import DTensor

    local = param.to_local() if isinstance(param, DTensor) else param
    return local.device
