"""Sharding rules for aten ops whose operands carry a RaggedShard placement.

[Note: what an op on a ragged DTensor may do]
A ragged local tensor is a flat 1-D slice of X's storage, so an op is correct on it only if it acts
element by element (or on whole-tensor reductions that combine across ranks). We accept:
- elementwise ops (aten ops tagged pointwise, detach/clone/copy/fill/zero/_to_copy/*_like, every
  ``_foreach_*`` elementwise variant and the fused optimizer kernels) when all ragged operands share
  one layout; a Replicate operand of the same shape is sliced to it (no communication), a Replicate
  scalar passes through;
- ``sum`` over all elements -> Partial(sum); ``linalg_vector_norm`` / ``_foreach_norm`` over all
  elements -> the p-norm partial torch uses for Shard, so ``clip_grad_norm_`` works unchanged;
  ``any``/``all``/``prod``/``max``/``min`` over all elements -> the matching Partial;
- reductions over some dims (sum, mean, p-norms, amax, amin): a share of whole dim-0 slices
  stays ragged over the kept rows (no communication); any other share is reduced padded to the
  full shape into a Partial result (``_padded_partial``).
``new_*`` factories of the global shape stay ragged; of any other shape they are Replicate
(torch's rule for Shard). Views and reshapes to any shape keep the flat share, and row-wise ops
on whole-row shares run as torch's Shard(0) rule says (rows.py). Everything else (transposes,
slicing, products over some dims, ...) takes the fallback (fallback.py): its ragged operands are
redistributed to Replicate for torch's own rule, or, in strict mode, it raises
``RaggedOpError`` naming the op and the placement. Never a wrong value.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from ragged_dtensor._private.fallback import RaggedOpError, propagate_fallback
from ragged_dtensor._private.placement import (
    RaggedBoxView,
    RaggedBroadcastView,
    RaggedNonEmptyView,
    RaggedPaddedView,
    RaggedShard,
)
from ragged_dtensor._private.rows import reshape_rule, row_rule

__all__ = ["RaggedOpError", "has_ragged", "propagate_ragged"]

aten = torch.ops.aten


def has_ragged(spec: object) -> bool:
    return isinstance(spec, DTensorSpec) and any(
        isinstance(p, RaggedShard) for p in spec.placements
    )


def _schema_has_ragged(schema: OpSchema) -> bool:
    for arg in (*schema.args_schema, *schema.kwargs_schema.values()):
        if has_ragged(arg):
            return True
        if isinstance(arg, list | tuple) and any(has_ragged(a) for a in arg):
            return True
    return False


_ELEMENTWISE_EXTRA = {
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.copy_.default,
    aten.zero_.default,
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.empty_like.default,
    aten.full_like.default,
    aten.to.dtype,
}
# random ops: elementwise in layout; their values come from random.py, which dispatch reaches
# only through its slow path (``_random_rule`` asks for it)
_RANDOM_LIKE = {
    op
    for packet in (aten.rand_like, aten.randn_like, aten.randint_like)
    for name in packet.overloads()  # type: ignore[no-untyped-call]
    if not name.endswith("out") and "Tensor" not in name
    for op in [getattr(packet, name)]
}
_RANDOM_FILLS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float}
RANDOM_OPS = _RANDOM_LIKE | _RANDOM_FILLS
# foreach ops that are not elementwise: reductions, and the matrix product
_FOREACH_NOT_ELEMENTWISE = ("aten::_foreach_norm", "aten::_foreach_max", "aten::_foreach_mm")


def _op_name(op: torch._ops.OpOverload) -> str:
    return str(op._schema.name)  # "aten::_foreach_norm" (no overload suffix)


def _is_elementwise(op: torch._ops.OpOverload) -> bool:
    if op in _ELEMENTWISE_EXTRA or torch.Tag.pointwise in op.tags:
        return True
    name = _op_name(op)
    if name.startswith(_FOREACH_NOT_ELEMENTWISE):
        return False
    return name.startswith(("aten::_foreach_", "aten::_fused_adam", "aten::_fused_sgd"))


def _error(op: torch._ops.OpOverload, spec: DTensorSpec, why: str) -> RaggedOpError:
    return RaggedOpError(
        f"{op} on a DTensor with placements {spec.placements} (shape {tuple(spec.shape)}): {why}"
    )


def _first_ragged(schema: OpSchema) -> DTensorSpec:
    for arg in (*schema.args_schema, *schema.kwargs_schema.values()):
        if has_ragged(arg):
            assert isinstance(arg, DTensorSpec)
            return arg
        if isinstance(arg, list | tuple):
            for a in arg:
                if has_ragged(a):
                    assert isinstance(a, DTensorSpec)
                    return a
    raise AssertionError("no ragged operand")


def _with_meta(spec: DTensorSpec, placements: Sequence[Placement], meta: object) -> DTensorSpec:
    assert meta is None or isinstance(meta, TensorMeta)
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta)


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


def _reduced_placements(spec: DTensorSpec, partial: Callable[[], Placement]) -> list[Placement]:
    out: list[Placement] = []
    for p in spec.placements:
        if isinstance(p, RaggedShard) or p.is_shard():
            out.append(partial())
        elif p.is_replicate():
            out.append(Replicate())
        else:
            raise RaggedOpError(f"cannot reduce a DTensor that is already {p} on another mesh axis")
    return out


def _covers_all_dims(dim: object, ndim: int) -> bool:
    if dim is None:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)  # type: ignore[call-overload]
    return not dims or sorted(d % max(ndim, 1) for d in dims) == list(range(ndim))


def _norm_partial(ord_: object) -> Placement:
    """How per-rank p-norms combine (torch's rule): max for inf, min for -inf, a sum of counts
    for 0, the p-norm partial otherwise."""
    from torch.distributed.tensor._ops._math_ops import _NormPartial

    value = 2.0 if ord_ is None else float(ord_)  # type: ignore[arg-type]
    if value == math.inf:
        return Partial("max")
    if value == -math.inf:
        return Partial("min")
    if value == 0:
        return Partial("sum")
    placement: Placement = _NormPartial(norm_type=value)
    return placement


# row-wise reductions: op -> (position of dims, of keepdim)
_ROWWISE = {
    aten.sum.dim_IntList: (1, 2),
    aten.mean.dim: (1, 2),
    aten.linalg_vector_norm.default: (2, 3),
    aten.amax.default: (1, 2),
    aten.amin.default: (1, 2),
}
_ROWWISE_KW = {1: "dim", 2: "keepdim", 3: "keepdim"}


def _arg(schema: OpSchema, index: int, name: str, default: object) -> object:
    if len(schema.args_schema) > index:
        return schema.args_schema[index]
    return schema.kwargs_schema.get(name, default)


def _rowwise(
    schema: OpSchema,
    meta: object,
    x_shape_of: Callable[[DTensorSpec], tuple[int, ...]],
) -> OutputSharding | None:
    """Reductions over trailing dims of a share made of whole dim-0 slices: rows stay ragged.

    The share is viewed as its box (``RaggedBoxView``, a local view), reduced locally, and the
    result is ragged over dim 0 with each rank's row count: no communication.
    """
    op = schema.op
    if op not in _ROWWISE:
        return None
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    dim_pos, keep_pos = _ROWWISE[op]
    dim = _arg(schema, dim_pos, "dim", None)
    keepdim = bool(_arg(schema, keep_pos, "keepdim", False))
    ndim = spec.ndim
    if dim is None or _covers_all_dims(dim, ndim):
        return None  # whole-tensor reductions: see _reduction
    dims = {d % ndim for d in ([dim] if isinstance(dim, int) else list(dim))}  # type: ignore[call-overload]
    axes = [a for a, p in enumerate(spec.placements) if isinstance(p, RaggedShard)]
    others_replicated = all(
        p.is_replicate() for a, p in enumerate(spec.placements) if a not in axes
    )
    placement = spec.placements[axes[0]]
    assert isinstance(placement, RaggedShard)
    xs = x_shape_of(spec)
    if not others_replicated:
        raise _error(
            op,
            spec,
            f"reduction over dims {sorted(dims)} needs the other mesh axes replicated; "
            "redistribute first",
        )
    # keepdim: the flat share of the (rows, 1, ...) result is the (rows,) result, so the op
    # runs without keepdim (a positional keepdim only: dispatch takes keywords as they are)
    keep_positional = keepdim and len(schema.args_schema) > keep_pos
    if not (0 not in dims and placement.is_box(xs) and (keep_positional or not keepdim)):
        return _padded_partial(schema, spec, axes[0], placement, meta)
    row = math.prod(xs[1:])
    rows = tuple(placement.local_numel(xs, k) // row for k in range(len(placement.local_units)))
    out_placements = list(spec.placements)
    out_placements[axes[0]] = RaggedShard((0,), rows)
    view_placements = list(spec.placements)
    view_placements[axes[0]] = RaggedBoxView(placement.dims, placement.local_units)
    view_spec = DTensorSpec(spec.mesh, tuple(view_placements), tensor_meta=spec.tensor_meta)
    args = [view_spec, *schema.args_schema[1:]]
    if keep_positional:
        args[keep_pos] = False
    new_schema = OpSchema(op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info)
    sharding = OutputSharding(
        _with_meta(spec, out_placements, meta),
        redistribute_schema=new_schema,
        needs_redistribute=True,
        use_val_from_redistribute_schema=keep_positional,
    )
    if len(xs) - len(dims) > 1:  # the local result is (rows, ...): a ragged share is flat
        sharding._ragged_flatten = True  # type: ignore[attr-defined]
    return sharding


# partial result of each row-wise reduction over a padded share: (fill value, partial placement)
def _partial_for(op: torch._ops.OpOverload, schema: OpSchema) -> tuple[float, Placement]:
    if op is aten.linalg_vector_norm.default:
        ord_ = _arg(schema, 1, "ord", 2)
        value = float(ord_)  # type: ignore[arg-type]
        if -math.inf < value < 0:
            raise _error(op, _first_ragged(schema), f"a norm of order {ord_} over some dims")
        # padding must not change the result: +inf for the min-abs "norm", 0 otherwise
        return (math.inf if value == -math.inf else 0.0), _norm_partial(ord_)
    if op in (aten.amax.default, aten.max.default):
        return float("-inf"), Partial("max")
    if op in (aten.amin.default, aten.min.default):
        return float("inf"), Partial("min")
    if op in (aten.all.default, aten.prod.default):
        return 1.0, Partial("product")
    return 0.0, Partial("sum")  # sum, mean (each rank's sum / the full count), any


def _padded_partial(
    schema: OpSchema,
    spec: DTensorSpec,
    axis: int,
    placement: RaggedShard,
    meta: object,
) -> OutputSharding:
    """A reduction over some dims of a flat share that is not a box (or that reduces dim 0).

    Each rank writes its share into a tensor of X's full shape filled with the reduction's
    identity (0 for sums, means and p-norms; -inf/+inf for max/min) and reduces it locally: its
    result has the full output shape and is this rank's partial value, so the output is
    ``Partial`` (or the norm partial) on the ragged axis. No communication; the padded copy has
    the size of the whole tensor on every rank.
    """
    fill, partial = _partial_for(schema.op, schema)
    out_placements = list(spec.placements)
    out_placements[axis] = partial
    view_placements = list(spec.placements)
    view_placements[axis] = RaggedPaddedView(placement.dims, placement.local_units, fill=fill)
    view_spec = DTensorSpec(spec.mesh, tuple(view_placements), tensor_meta=spec.tensor_meta)
    new_schema = OpSchema(
        schema.op,
        (view_spec, *schema.args_schema[1:]),
        schema.kwargs_schema,
        schema_info=schema.schema_info,
    )
    return OutputSharding(
        _with_meta(spec, out_placements, meta),
        redistribute_schema=new_schema,
        needs_redistribute=True,
    )


# whole-tensor reductions, combined across ranks like torch combines Shard partials
_WHOLE_REDUCTIONS = {
    aten.any.default: "sum",
    aten.all.default: "product",
    aten.prod.default: "product",
    aten.max.default: "max",
    aten.min.default: "min",
}


def _padded_whole(schema: OpSchema, spec: DTensorSpec, meta: object) -> OutputSharding:
    axes = [a for a, p in enumerate(spec.placements) if isinstance(p, RaggedShard)]
    if not all(p.is_replicate() for a, p in enumerate(spec.placements) if a not in axes):
        raise _error(
            schema.op, spec, "a whole-tensor reduction needs the other mesh axes replicated"
        )
    placement = spec.placements[axes[0]]
    assert isinstance(placement, RaggedShard)
    return _padded_partial(schema, spec, axes[0], placement, meta)


def _flat_dims(
    schema: OpSchema, out: OutputSharding, dim_pos: int, keep_pos: int
) -> OutputSharding | None:
    """A whole-tensor reduction named by its dims (``x.sum(dim=(0, 1))``) runs on the flat
    1-D share as a reduction over its dim 0; None with ``keepdim`` (the local result would
    have the wrong rank: the caller pads instead)."""
    dim = _arg(schema, dim_pos, "dim", None)
    if dim is None or (isinstance(dim, list | tuple) and not dim):
        return out  # the local op reduces everything already
    if bool(_arg(schema, keep_pos, "keepdim", False)):
        return None
    args = list(schema.args_schema)
    kwargs = dict(schema.kwargs_schema)
    if len(args) > dim_pos:
        args[dim_pos] = [0]
    else:
        kwargs["dim"] = [0]
    new_schema = OpSchema(schema.op, tuple(args), kwargs, schema_info=schema.schema_info)
    return OutputSharding(
        out.output_spec,
        redistribute_schema=new_schema,
        needs_redistribute=True,
        use_val_from_redistribute_schema=True,
    )


def _reduction(
    schema: OpSchema, meta: object, local_numel: Callable[[DTensorSpec], int]
) -> OutputSharding | None:
    op = schema.op
    args = schema.args_schema
    if op in (aten.sum.default, aten.sum.dim_IntList):
        spec = args[0]
        assert isinstance(spec, DTensorSpec)
        dim = _arg(schema, 1, "dim", None)
        if op is aten.sum.default:
            return OutputSharding(_with_meta(spec, _reduced_placements(spec, Partial), meta))
        if _covers_all_dims(dim, spec.ndim):
            out = OutputSharding(_with_meta(spec, _reduced_placements(spec, Partial), meta))
            return _flat_dims(schema, out, 1, 2) or _padded_whole(schema, spec, meta)
        raise _error(
            op,
            spec,
            f"sum over dims {dim} of a flat ragged share is not supported; "
            "sum over all elements (-> Partial) or redistribute first",
        )
    if op in (aten.mean.default, aten.mean.dim):
        spec = args[0]
        assert isinstance(spec, DTensorSpec)
        if op is aten.mean.default or _covers_all_dims(_arg(schema, 1, "dim", None), spec.ndim):
            # each rank's sum over the full count: the share padded with zeros ([Note: ...]
            # _padded_partial), so the result is Partial(sum)
            return _padded_whole(schema, spec, meta)
        return None
    if op is aten.linalg_vector_norm.default:
        spec = args[0]
        assert isinstance(spec, DTensorSpec)
        ord_ = args[1] if len(args) > 1 else schema.kwargs_schema.get("ord", 2)
        dim = args[2] if len(args) > 2 else schema.kwargs_schema.get("dim")
        if _covers_all_dims(dim, spec.ndim):
            if abs(float(ord_)) == math.inf:  # type: ignore[arg-type]
                # no identity: an empty share would fail ([Note: norms without an identity])
                if dim is None:
                    return _non_empty_norms(schema, [spec], [meta], float(ord_))  # type: ignore[arg-type]
                return _padded_whole(schema, spec, meta)
            placements = _reduced_placements(spec, lambda: _norm_partial(ord_))
            out = OutputSharding(_with_meta(spec, placements, meta))
            return _flat_dims(schema, out, 2, 3) or _padded_whole(schema, spec, meta)
        raise _error(op, spec, f"norm over dims {dim} of a flat ragged share is not supported")
    first = args[0] if args else None
    if isinstance(first, DTensorSpec) and (
        op in _WHOLE_REDUCTIONS
        or (
            op in (aten.amax.default, aten.amin.default)
            and _covers_all_dims(_arg(schema, 1, "dim", None) or None, first.ndim)
        )
    ):
        return _padded_whole(schema, first, meta)
    if _op_name(op) == "aten::_foreach_norm":
        specs = args[0]
        assert isinstance(specs, list | tuple)
        ord_ = args[1] if len(args) > 1 else schema.kwargs_schema.get("ord", 2)
        assert isinstance(meta, list | tuple)
        if abs(float(ord_)) == math.inf:  # type: ignore[arg-type]
            return _non_empty_norms(schema, list(specs), list(meta), float(ord_))  # type: ignore[arg-type]
        norms = []
        for spec, m in zip(specs, meta, strict=True):
            assert isinstance(spec, DTensorSpec)
            norms.append(
                _with_meta(spec, _reduced_placements(spec, lambda: _norm_partial(ord_)), m)
            )
        return OutputSharding(norms)
    return None


def _non_empty_norms(
    schema: OpSchema, specs: list[object], metas: list[object], ord_: float
) -> OutputSharding:
    """[Note: norms without an identity]
    The inf and -inf norms (max / min of ``|x|``) of an empty tensor are undefined, and torch
    raises on them ("cannot compute the infinity norm on an empty tensor"); a ragged share is
    empty whenever the layout gives a rank no element of a tensor (common: a planner packs
    whole tensors). Each ragged operand is read through ``RaggedNonEmptyView``: an empty share
    becomes one element that is the identity of the combination (0 for inf, the partial
    values being >= 0; +inf for -inf), a non-empty one is read as it is. Each rank's result is
    then its partial value and ``Partial("max")`` / ``Partial("min")`` combine them: the norm
    of the whole tensor, every rank the same, as one process computes it. (A tensor with no
    element at all gives 0 for inf where torch raises; -inf gives +inf.) Works for
    ``linalg_vector_norm`` over all elements and ``_foreach_norm`` (``clip_grad_norm_`` with
    ``norm_type=inf``); non-ragged operands keep their own rule."""
    fill = 0.0 if ord_ > 0 else math.inf
    views: list[object] = []
    outs: list[DTensorSpec] = []
    for spec, meta in zip(specs, metas, strict=True):
        assert isinstance(spec, DTensorSpec)
        outs.append(_with_meta(spec, _reduced_placements(spec, lambda: _norm_partial(ord_)), meta))
        if not has_ragged(spec):
            views.append(spec)
            continue
        placements = [
            RaggedNonEmptyView(p.dims, p.local_units, fill=fill)
            if isinstance(p, RaggedShard)
            else p
            for p in spec.placements
        ]
        views.append(DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta))
    args = list(schema.args_schema)
    args[0] = views if isinstance(args[0], list | tuple) else views[0]
    new_schema = OpSchema(
        schema.op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info
    )
    return OutputSharding(
        outs if isinstance(schema.args_schema[0], list | tuple) else outs[0],
        redistribute_schema=new_schema,
        needs_redistribute=True,
    )


# ops whose size (and stride) argument names the *global* shape: index of size, of stride
_SHAPE_ARG_OPS: dict[torch._ops.OpOverload, tuple[int, int | None]] = {
    aten.new_empty_strided.default: (1, 2),
    aten.new_empty.default: (1, None),
    aten.new_zeros.default: (1, None),
    aten.new_ones.default: (1, None),
    aten.new_full.default: (1, None),
    aten.view.default: (1, None),
    aten._unsafe_view.default: (1, None),
    aten.reshape.default: (1, None),
    aten.expand.default: (1, None),
}
_NEW_FACTORIES = {
    aten.new_empty_strided.default,
    aten.new_empty.default,
    aten.new_zeros.default,
    aten.new_ones.default,
    aten.new_full.default,
}


def _shape_arg_op(
    schema: OpSchema,
    meta: object,
    local_numel: Callable[[DTensorSpec], int],
) -> OutputSharding | None:
    """Same-shape views and ``new_*`` factories: rewrite the size to this rank's flat share.

    A ``new_*`` factory of another size only borrows the operand's dtype and device: like
    torch's rule for a Shard operand, the result is a Replicate tensor of that size (each rank
    makes the whole of it; DCP's state-dict stager calls ``new_empty([])``).
    """
    op = schema.op
    if op not in _SHAPE_ARG_OPS:
        return None
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    size_idx, stride_idx = _SHAPE_ARG_OPS[op]
    size = schema.args_schema[size_idx]
    assert isinstance(size, list | tuple)
    if [int(s) for s in size] != list(spec.shape):
        if op in _NEW_FACTORIES:
            replicated = (Replicate(),) * spec.mesh.ndim
            return OutputSharding(_with_meta(spec, replicated, meta))
        raise _error(
            op,
            spec,
            f"size {list(size)} differs from the global shape; a ragged share is a flat "
            "range, so only same-shape views are supported (redistribute first)",
        )
    args = list(schema.args_schema)
    args[size_idx] = [local_numel(spec)]
    if stride_idx is not None:
        args[stride_idx] = [1]
    new_schema = OpSchema(op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info)
    assert isinstance(meta, TensorMeta)
    return OutputSharding(
        _with_meta(spec, spec.placements, meta),
        redistribute_schema=new_schema,
        needs_redistribute=True,
        use_val_from_redistribute_schema=True,
    )


def _random_rule(schema: OpSchema, meta: object) -> OutputSharding | None:
    """A random op keeps its operand's layout; asking for a (no-op) redistribution sends
    dispatch through its Python slow path, where random.py draws the values."""
    if schema.op not in RANDOM_OPS:
        return None
    result = _elementwise(schema, meta)
    return OutputSharding(
        result.output_spec,
        redistribute_schema=result.redistribute_schema or schema,
        needs_redistribute=True,
    )


def propagate_ragged(
    schema: OpSchema,
    tensor_meta: Callable[[OpSchema], Any],
    local_numel: Callable[[DTensorSpec], int],
    x_shape_of: Callable[[DTensorSpec], tuple[int, ...]],
    torch_propagate: Callable[[OpSchema], OutputSharding],
) -> OutputSharding:
    """The output sharding of ``schema`` (which has at least one ragged operand).

    The ragged rules first; where none applies (or one refuses these operands), the fallback:
    the ragged operands are redistributed for torch's own rule ([Note: the fallback
    redistribution] in fallback.py). ``local_numel(spec)`` is this rank's number of elements
    of a ragged spec (the only rank-dependent input; the propagator's cache is per thread,
    hence per rank).
    """
    op = schema.op
    try:
        meta = tensor_meta(schema)
    except Exception:  # a value-dependent shape (item, masked_select, nonzero...)
        return propagate_fallback(schema, torch_propagate, "its output depends on the values")
    rules: tuple[Callable[[], OutputSharding | None], ...] = (
        lambda: _random_rule(schema, meta),
        lambda: _rowwise(schema, meta, x_shape_of),  # it owns partial-dim reductions
        lambda: _reduction(schema, meta, local_numel),
        lambda: reshape_rule(schema, meta, local_numel),
        lambda: _shape_arg_op(schema, meta, local_numel),
        lambda: row_rule(schema, torch_propagate),
        lambda: _memory_format(schema, _elementwise(schema, meta)) if _is_elementwise(op) else None,
    )
    try:
        for rule in rules:
            result = rule()
            if result is not None:
                return result
    except RaggedOpError as exc:
        why = str(exc).split("): ", 1)[-1]
        return propagate_fallback(schema, torch_propagate, why)
    return propagate_fallback(
        schema, torch_propagate, "this op is not elementwise and has no ragged sharding rule"
    )


def schema_has_ragged(schema: OpSchema) -> bool:
    return _schema_has_ragged(schema)
