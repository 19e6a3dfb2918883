"""Redistribution to, from and between RaggedShard placements: plan, then execute.

``plan_redistribute`` is a pure, cached function from (mesh shape, source and target placements,
the shapes the ragged axes cut) to a tuple of frozen ``RedistributeStep``s; ``execute`` runs them.

[Note: one collective per transition]
Each single-axis transition costs exactly one collective: RaggedShard -> Replicate one all-gather,
Partial -> RaggedShard one reduce-scatter, RaggedShard <-> RaggedShard and RaggedShard <-> Shard(0)
one all-to-all that moves each element at most once, Replicate -> RaggedShard none (a local copy
of the share, as torch's Replicate -> Shard makes).
Transitions that also change other mesh axes in ways that move data (Shard <-> anything) go through
Replicate on the ragged axis, and the standard part is handed to torch's own redistribution.
Partial -> Replicate on another axis is elementwise, so it runs on the small ragged share
(HSDP gradient sync is one reduce-scatter plus one all-reduce of the shard, not of the full tensor).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ragged_dtensor._private import collectives
from ragged_dtensor._private.geometry import FlatRange
from ragged_dtensor._private.placement import RaggedShard

__all__ = [
    "RedistributeStep",
    "StepKind",
    "execute",
    "plan_redistribute",
    "ragged_axis",
    "x_shape",
]


class StepKind(enum.Enum):
    GATHER = "all-gather"  # RaggedShard -> Replicate on one axis
    SLICE = "slice"  # Replicate -> RaggedShard on one axis (no communication)
    REDUCE_SCATTER = "reduce-scatter"  # Partial -> RaggedShard on one axis
    ALL_TO_ALL = "all-to-all"  # RaggedShard/Shard(0) -> RaggedShard/Shard(0) on one axis
    TO_PARTIAL = "to-partial"  # RaggedShard -> Partial on one axis (no communication)
    ALL_REDUCE = "all-reduce"  # Partial -> Replicate on a non-ragged axis, elementwise
    TORCH = "torch"  # standard placements only: torch's own redistribution


@attrs.frozen
class RedistributeStep:
    kind: StepKind
    axis: int
    before: tuple[Placement, ...]
    after: tuple[Placement, ...]
    x_shape: tuple[int, ...] = ()
    src_ranges: tuple[FlatRange, ...] = ()
    dst_ranges: tuple[FlatRange, ...] = ()
    reduce_op: str = "sum"


def ragged_axis(placements: Sequence[Placement]) -> int | None:
    """The mesh axis carrying a RaggedShard, or None. Raises if there are several."""
    axes = [i for i, p in enumerate(placements) if isinstance(p, RaggedShard)]
    if len(axes) > 1:
        raise ValueError(
            f"placements {tuple(placements)} carry RaggedShard on mesh axes {axes}: "
            f"at most one mesh axis may be ragged"
        )
    return axes[0] if axes else None


def _without_ragged(placements: Sequence[Placement]) -> tuple[Placement, ...]:
    return tuple(Replicate() if isinstance(p, RaggedShard) else p for p in placements)


def x_shape(
    global_shape: Sequence[int],
    mesh: DeviceMesh,
    placements: Sequence[Placement],
) -> tuple[int, ...]:
    """Shape of X, the tensor the ragged axis cuts: global shape after every other placement."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    std = _without_ragged(placements)
    if all(not p.is_shard() for p in std):
        return tuple(global_shape)
    shape, _ = compute_local_shape_and_global_offset(torch.Size(global_shape), mesh, std)
    return tuple(int(s) for s in shape)


def _chunk_rows(rows: int, world: int, rank: int) -> int:
    """Rows of dim 0 that torch.chunk gives ``rank`` (ceil to the first ranks, maybe 0 last)."""
    chunk = -(-rows // world) if rows else 0
    return max(0, min((rank + 1) * chunk, rows) - min(rank * chunk, rows))


def _chunk_ranges(shape: Sequence[int], world: int) -> tuple[FlatRange, ...]:
    """Flat ranges of Shard(0) with torch.chunk semantics (ceil rows to the first ranks)."""
    rows = shape[0] if shape else 1
    row = 1
    for s in shape[1:]:
        row *= s
    chunk = -(-rows // world) if rows else 0
    out = []
    for k in range(world):
        lo, hi = min(k * chunk, rows), min((k + 1) * chunk, rows)
        out.append(FlatRange(lo * row, hi * row))
    return tuple(out)


def _ragged_ranges(p: RaggedShard, shape: Sequence[int], world: int) -> tuple[FlatRange, ...]:
    if len(p.local_units) != world:
        raise ValueError(
            f"{p!r} has {len(p.local_units)} local_units but its mesh axis has {world} ranks"
        )
    p.validate(shape)
    return tuple(p.flat_range(shape, k) for k in range(world))


def _flat_ranges(p: Placement, shape: Sequence[int], world: int) -> tuple[FlatRange, ...]:
    if isinstance(p, RaggedShard):
        return _ragged_ranges(p, shape, world)
    assert isinstance(p, Shard) and p.dim == 0
    return _chunk_ranges(shape, world)


def _is_shard0(p: Placement) -> bool:
    return type(p) is Shard and p.dim == 0


def _elementwise_transition(a: Placement, b: Placement) -> bool:
    return a == b or (a.is_partial() and b.is_replicate())


@functools.lru_cache(maxsize=4096)
def plan_redistribute(
    mesh_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    src_x: tuple[int, ...],
    dst_x: tuple[int, ...],
) -> tuple[RedistributeStep, ...]:
    """Plan the steps from ``src`` to ``dst`` placements (at least one of them ragged).

    ``src_x`` / ``dst_x`` are the shapes of X under the source / target placements (see
    ``x_shape``). Pure and cached: the same inputs give the same frozen steps on every rank.
    """
    ra, rb = ragged_axis(src), ragged_axis(dst)
    if ra is None and rb is None:
        return (RedistributeStep(StepKind.TORCH, -1, src, dst),) if src != dst else ()
    steps: list[RedistributeStep] = []
    cur = list(src)

    def emit(kind: StepKind, axis: int, new: Placement, **kw: object) -> None:
        before = tuple(cur)
        cur[axis] = new
        steps.append(RedistributeStep(kind, axis, before, tuple(cur), **kw))  # type: ignore[arg-type]

    def reduce_others(skip: int) -> None:
        for b in range(len(mesh_shape)):
            if b != skip and cur[b] != dst[b]:
                op = str(getattr(cur[b], "reduce_op", "sum"))
                emit(StepKind.ALL_REDUCE, b, dst[b], reduce_op=op)

    axis = ra if ra is not None else rb
    assert axis is not None
    others_elementwise = all(
        _elementwise_transition(src[b], dst[b]) for b in range(len(mesh_shape)) if b not in (ra, rb)
    )
    shard0_elsewhere = any(
        p.is_shard(0) for b, p in enumerate(src + dst) if b % len(mesh_shape) != axis
    )
    world = mesh_shape[axis]
    if others_elementwise and (ra is None or rb is None or ra == rb):
        s, d = src[axis], dst[axis]
        if isinstance(s, RaggedShard) and isinstance(d, RaggedShard):
            reduce_others(axis)
            if s != d:
                emit(
                    StepKind.ALL_TO_ALL,
                    axis,
                    d,
                    x_shape=src_x,
                    src_ranges=_ragged_ranges(s, src_x, world),
                    dst_ranges=_ragged_ranges(d, src_x, world),
                )
            return tuple(steps)
        if isinstance(d, RaggedShard):  # standard -> ragged on this axis
            x = dst_x
            dst_ranges = _ragged_ranges(d, x, world)
            if s.is_replicate():
                emit(StepKind.SLICE, axis, d, x_shape=x, dst_ranges=dst_ranges)
            elif s.is_partial():
                emit(
                    StepKind.REDUCE_SCATTER,
                    axis,
                    d,
                    x_shape=x,
                    dst_ranges=dst_ranges,
                    reduce_op=str(getattr(s, "reduce_op", "sum")),
                )
            elif _is_shard0(s) and not shard0_elsewhere:
                emit(
                    StepKind.ALL_TO_ALL,
                    axis,
                    d,
                    x_shape=x,
                    src_ranges=_chunk_ranges(x, world),
                    dst_ranges=dst_ranges,
                )
            else:  # Shard(k) or exotic: through Replicate
                before = tuple(cur)
                cur[axis] = Replicate()
                steps.append(RedistributeStep(StepKind.TORCH, axis, before, tuple(cur)))
                emit(StepKind.SLICE, axis, d, x_shape=x, dst_ranges=dst_ranges)
            reduce_others(axis)
            return tuple(steps)
        # ragged -> standard on this axis
        assert isinstance(s, RaggedShard)
        reduce_others(axis)
        x = src_x
        src_ranges = _ragged_ranges(s, x, world)
        if d.is_replicate():
            emit(StepKind.GATHER, axis, d, x_shape=x, src_ranges=src_ranges)
        elif d.is_partial():
            op = str(getattr(d, "reduce_op", "sum"))
            if op not in ("sum", "avg"):
                raise ValueError(
                    f"cannot express {s!r} as Partial({op!r}): only sum/avg partials "
                    f"can be formed without communication"
                )
            emit(StepKind.TO_PARTIAL, axis, d, x_shape=x, src_ranges=src_ranges, reduce_op=op)
        elif _is_shard0(d) and not shard0_elsewhere:
            emit(
                StepKind.ALL_TO_ALL,
                axis,
                d,
                x_shape=x,
                src_ranges=src_ranges,
                dst_ranges=_chunk_ranges(x, world),
            )
        else:
            emit(StepKind.GATHER, axis, Replicate(), x_shape=x, src_ranges=src_ranges)
            before = tuple(cur)
            cur[axis] = d
            steps.append(RedistributeStep(StepKind.TORCH, axis, before, tuple(cur)))
        return tuple(steps)

    # General case: other axes move data. Leave the ragged axis through Replicate, let torch
    # move the standard placements, re-enter the ragged axis at the end.
    if ra is not None:
        source = src[ra]
        assert isinstance(source, RaggedShard)
        emit(
            StepKind.GATHER,
            ra,
            Replicate(),
            x_shape=src_x,
            src_ranges=_ragged_ranges(source, src_x, mesh_shape[ra]),
        )
    mid = list(dst)
    if rb is not None:
        mid[rb] = cur[rb] if (cur[rb].is_replicate() or cur[rb].is_partial()) else Replicate()
    if tuple(cur) != tuple(mid):
        before = tuple(cur)
        cur[:] = mid
        steps.append(RedistributeStep(StepKind.TORCH, -1, before, tuple(cur)))
    if rb is not None:
        d = dst[rb]
        assert isinstance(d, RaggedShard)
        ranges = _ragged_ranges(d, dst_x, mesh_shape[rb])
        if cur[rb].is_partial():
            emit(
                StepKind.REDUCE_SCATTER,
                rb,
                d,
                x_shape=dst_x,
                dst_ranges=ranges,
                reduce_op=str(getattr(cur[rb], "reduce_op", "sum")),
            )
        else:
            emit(StepKind.SLICE, rb, d, x_shape=dst_x, dst_ranges=ranges)
    return tuple(steps)


TorchRedistribute = Callable[
    [torch.Tensor, tuple[Placement, ...], tuple[Placement, ...]], torch.Tensor
]


def execute(
    steps: Sequence[RedistributeStep],
    local: torch.Tensor,
    mesh: DeviceMesh,
    torch_redistribute: TorchRedistribute,
) -> torch.Tensor:
    """Run planned steps on this rank's local tensor."""
    for step in steps:
        local = _run_step(step, local, mesh, torch_redistribute)
    return local


def _run_step(
    step: RedistributeStep,
    local: torch.Tensor,
    mesh: DeviceMesh,
    torch_redistribute: TorchRedistribute,
) -> torch.Tensor:
    kind = step.kind
    if kind is StepKind.TORCH:
        return torch_redistribute(local, step.before, step.after)
    group = mesh.get_group(step.axis)
    rank = mesh.get_local_rank(step.axis)
    if kind is StepKind.GATHER:
        return collectives.all_gather_flat(local, step.src_ranges, group).view(step.x_shape)
    if kind is StepKind.SLICE:
        # a copy, as torch's Replicate -> Shard makes: a view would keep the whole replicated
        # tensor alive, and a DTensor over a view at a storage offset trips DCP's stager
        r = step.dst_ranges[rank]
        return local.reshape(-1)[r.start : r.stop].clone()
    if kind is StepKind.REDUCE_SCATTER:
        return collectives.reduce_scatter_flat(local, step.dst_ranges, rank, step.reduce_op, group)
    if kind is StepKind.ALL_TO_ALL:
        out = collectives.all_to_all_flat(local, step.src_ranges, step.dst_ranges, rank, group)
        after = step.after[step.axis]
        if not isinstance(after, RaggedShard):  # Shard(0): back to its box shape
            rows = _chunk_rows(step.x_shape[0], len(step.dst_ranges), rank)
            return out.view(rows, *step.x_shape[1:])
        return out
    if kind is StepKind.TO_PARTIAL:
        r = step.src_ranges[rank]
        full = local.new_zeros(_numel(step.x_shape))
        piece = local.reshape(-1)
        if step.reduce_op == "avg":
            piece = piece * len(step.src_ranges)
        full[r.start : r.stop] = piece
        return full.view(step.x_shape)
    if kind is StepKind.ALL_REDUCE:
        out = local.clone()
        dist.all_reduce(out, op=collectives.reduce_op(step.reduce_op), group=group)
        if step.reduce_op == "avg":
            out = out / mesh.size(step.axis)
        return out
    raise AssertionError(f"unknown step {kind}")  # pragma: no cover


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
