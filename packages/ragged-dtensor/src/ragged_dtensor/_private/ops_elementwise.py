"""Elementwise ops on ragged operands (ops.py's first rule family): operands aligned to one ragged
layout (a Replicate operand sliced or broadcast to it, no communication), in-place writes kept in
layout, and layout memory formats on a flat share."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private.fallback import RaggedOpError
from ragged_dtensor._private.ops_common import (
    _error,
    _first_ragged,
    _with_meta,
    has_ragged,
)
from ragged_dtensor._private.placement import (
    RaggedBroadcastView,
    RaggedShard,
)


def _align_operands(
    op: torch._ops.OpOverload,
    group: Sequence[object],
) -> tuple[DTensorSpec | None, list[object], bool]:
    """Pick the reference ragged spec of one elementwise operand group and align the others.

    Returns (reference, new operand specs, whether any operand needs redistribution).
    """
    ragged = [s for s in group if has_ragged(s)]
    if not ragged:
        return None, list(group), False
    # the reference is the operand of the result's shape (a row-broadcast one may come first)
    ref = max(ragged, key=lambda s: s.shape.numel())  # type: ignore[attr-defined]
    assert isinstance(ref, DTensorSpec)
    moved = False
    out: list[object] = []
    for spec in group:
        if not isinstance(spec, DTensorSpec):
            out.append(spec)
            continue
        if has_ragged(spec):
            rows = _row_broadcast_view(spec, ref)
            if rows is not None:
                out.append(rows)
                moved = True
                continue
            if spec.placements != ref.placements or spec.shape != ref.shape:
                raise _error(
                    op,
                    spec,
                    f"operands have different layouts: {spec.placements} "
                    f"{tuple(spec.shape)} vs {ref.placements} {tuple(ref.shape)}; "
                    f"redistribute one of them first",
                )
            out.append(spec)
            continue
        if all(p.is_replicate() for p in spec.placements):
            if spec.shape.numel() == 1 and spec.ndim <= 1:
                out.append(spec)  # a scalar broadcasts against any flat share
                continue
            if spec.shape == ref.shape:
                out.append(DTensorSpec(ref.mesh, ref.placements, tensor_meta=spec.tensor_meta))
                moved = True
                continue
            view = _broadcast_view(spec, ref)
            if view is not None:
                out.append(view)
                moved = True
                continue
        raise _error(
            op,
            ref,
            f"operand with placements {spec.placements} and shape "
            f"{tuple(spec.shape)} cannot be combined elementwise with a ragged operand "
            f"(broadcasting against a flat ragged share is not supported)",
        )
    return ref, out, moved


def _broadcast_view(spec: DTensorSpec, ref: DTensorSpec, check: bool = True) -> DTensorSpec | None:
    """A Replicate operand that broadcasts to the ragged operand's shape, as the share of the
    broadcast tensor (``RaggedBroadcastView``), when the ragged operand's other mesh axes are
    replicated; None otherwise."""
    if check:
        if spec.ndim > ref.ndim:
            return None
        try:
            if _broadcast(spec.shape, ref.shape) != ref.shape:
                return None
        except RuntimeError:
            return None
    placements: list[Placement] = []
    for p in ref.placements:
        if isinstance(p, RaggedShard):
            placements.append(RaggedBroadcastView(p.dims, p.local_units, shape=tuple(ref.shape)))
        elif p.is_replicate():
            placements.append(p)
        else:
            return None
    return DTensorSpec(ref.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _broadcast(a: torch.Size, b: torch.Size) -> torch.Size:
    shape: torch.Size = torch.broadcast_shapes(a, b)  # type: ignore[no-untyped-call]
    return shape


def _box_rows(spec: DTensorSpec) -> tuple[int, tuple[int, ...]] | None:
    """(ragged axis, rows per rank) of a ragged spec whose shares are whole rows and whose
    other mesh axes are replicated; None otherwise."""
    axis = None
    for a, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard) and type(p) is RaggedShard and axis is None:
            axis = a
        elif not p.is_replicate():
            return None
    if axis is None or spec.ndim == 0:
        return None
    placement = spec.placements[axis]
    assert isinstance(placement, RaggedShard)
    shape = tuple(spec.shape)
    row = math.prod(shape[1:])
    if row == 0 or not placement.is_box(shape):
        return None
    return axis, tuple(
        placement.local_numel(shape, k) // row for k in range(len(placement.local_units))
    )


def _row_broadcast_view(spec: DTensorSpec, ref: DTensorSpec) -> DTensorSpec | None:
    """A ragged operand of whole rows that broadcasts along its other dims to the reference
    (``x * rstd`` with ``rstd`` of shape (N, 1)): each rank's rows expanded locally, when both
    hold the same rows; None otherwise."""
    if spec.shape == ref.shape or spec.ndim != ref.ndim or spec.shape[0] != ref.shape[0]:
        return None
    try:
        if _broadcast(spec.shape, ref.shape) != ref.shape:
            return None
    except RuntimeError:
        return None
    mine, theirs = _box_rows(spec), _box_rows(ref)
    if mine is None or theirs is None or mine != theirs:
        return None
    view = _broadcast_view(spec, ref, check=False)
    return view


def _plain_entry(op: torch._ops.OpOverload, group: Sequence[object]) -> DTensorSpec | None:
    """The spec of a foreach entry none of whose operands is ragged: its DTensor operands must
    share one placement (the result keeps it); None when it has no DTensor operand."""
    specs = [s for s in group if isinstance(s, DTensorSpec)]
    if not specs:
        return None
    first = specs[0]
    for spec in specs[1:]:
        if spec.placements != first.placements and spec.shape.numel() != 1:
            raise RaggedOpError(
                f"{op}: a foreach entry without a ragged operand mixes placements "
                f"{first.placements} and {spec.placements}"
            )
    return first


def _check_written_kept(schema: OpSchema, args: Sequence[object]) -> None:
    """An in-place op's written operand must keep its layout: a non-ragged one that would be
    sliced to a ragged operand's share cannot be written through (the fallback handles it)."""
    if not (schema.is_inplace_op() or schema.is_out_variant_op()) or not args:
        return
    before, after = schema.args_schema[0], args[0]
    pairs: Any = (
        zip(before, after, strict=True)  # type: ignore[call-overload]
        if isinstance(before, list | tuple)
        else [(before, after)]
    )
    for b, a in pairs:
        if isinstance(b, DTensorSpec) and not has_ragged(b) and a is not b:
            raise _error(
                schema.op,
                _first_ragged(schema),
                f"it writes into an operand with placements {b.placements}, which would have "
                f"to change layout",
            )


def _elementwise(schema: OpSchema, meta: object) -> OutputSharding:
    op = schema.op
    args = list(schema.args_schema)
    foreach = any(
        isinstance(a, list | tuple) and a and isinstance(a[0], DTensorSpec | type(None))
        for a in args
    )
    moved_any = False
    if foreach:
        lists = [
            i
            for i, a in enumerate(args)
            if isinstance(a, list | tuple) and any(isinstance(x, DTensorSpec) for x in a)
        ]
        first = args[lists[0]]
        assert isinstance(first, list | tuple)
        length = len(first)
        refs: list[DTensorSpec | None] = []
        new_lists: dict[int, list[object]] = {i: [] for i in lists}
        for j in range(length):
            group = [args[i][j] for i in lists]  # type: ignore[index]
            ref, aligned, moved = _align_operands(op, group)
            if ref is None:
                # an entry with no ragged operand (e.g. a replicated parameter in the same
                # optimizer list): elementwise on operands that share one placement
                ref = _plain_entry(op, group)
            moved_any |= moved
            refs.append(ref)
            for i, value in zip(lists, aligned, strict=True):
                new_lists[i].append(value)
        for i in lists:
            args[i] = type(args[i])(new_lists[i])  # type: ignore[call-arg]
        if meta is None:
            out_spec: object = None
        else:  # TensorMeta is a NamedTuple: a foreach op returns a list of them
            assert isinstance(meta, list | tuple)
            specs = []
            for ref, m in zip(refs, meta, strict=True):
                if ref is None:
                    raise _error(op, _first_ragged(schema), "mixed ragged/non-ragged foreach lists")
                specs.append(_with_meta(ref, ref.placements, m) if m is not None else None)
            out_spec = specs
    else:
        positions = [i for i, a in enumerate(args) if isinstance(a, DTensorSpec)]
        kw_positions = [k for k, v in schema.kwargs_schema.items() if isinstance(v, DTensorSpec)]
        group = [args[i] for i in positions] + [schema.kwargs_schema[k] for k in kw_positions]
        ref, aligned, moved_any = _align_operands(op, group)
        assert ref is not None
        for i, value in zip(positions, aligned, strict=False):
            args[i] = value
        kwargs = dict(schema.kwargs_schema)
        for k, value in zip(kw_positions, aligned[len(positions) :], strict=True):
            kwargs[k] = value
        if meta is None:
            out_spec = None
        elif not isinstance(meta, TensorMeta) and isinstance(meta, list | tuple):
            out_spec = tuple(_with_meta(ref, ref.placements, m) for m in meta)
        else:
            out_spec = _with_meta(ref, ref.placements, meta)
        if moved_any:
            _check_written_kept(schema, args)
            new_schema = OpSchema(op, tuple(args), kwargs, schema_info=schema.schema_info)
            return OutputSharding(
                out_spec,
                redistribute_schema=new_schema,
                needs_redistribute=True,
            )
        return OutputSharding(out_spec)
    if moved_any:
        _check_written_kept(schema, args)
        new_schema = OpSchema(op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info)
        return OutputSharding(
            out_spec,
            redistribute_schema=new_schema,
            needs_redistribute=True,
        )
    return OutputSharding(out_spec)


_LAYOUT_FORMATS = (torch.channels_last, torch.channels_last_3d)


def _memory_format(schema: OpSchema, result: OutputSharding) -> OutputSharding:
    """``.to(memory_format=channels_last)`` and the like on a ragged operand: the flat share
    has no dims to reorder, so the op runs with ``preserve_format`` (the slow-path hook
    rewrites the keyword: dispatch never takes keywords from a rule) and the result keeps the
    row-major layout of a ragged tensor (its global strides contiguous)."""
    if schema.kwargs_schema.get("memory_format") not in _LAYOUT_FORMATS:
        return result
    spec: Any = result.output_spec
    if isinstance(spec, DTensorSpec) and spec.tensor_meta is not None:
        meta = spec.tensor_meta
        stride = torch.empty(meta.shape, device="meta").stride()
        spec = _with_meta(spec, spec.placements, TensorMeta(meta.shape, stride, meta.dtype))
    return OutputSharding(
        spec,
        redistribute_schema=result.redistribute_schema or schema,
        needs_redistribute=True,
    )


def ragged_memory_format(args: Sequence[object], op_info: Any) -> None:
    """The slow-path half of ``_memory_format``: drop a layout memory format of an op on a
    ragged operand (called only when the local keywords hold one)."""
    if any(isinstance(a, torch.Tensor) and has_ragged(getattr(a, "_spec", None)) for a in args):
        op_info.local_kwargs["memory_format"] = torch.preserve_format
