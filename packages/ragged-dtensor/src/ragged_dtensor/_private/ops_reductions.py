"""Reductions on ragged operands (ops.py): whole-tensor reductions into Partial results, row-wise
reductions of whole-row shares, padded partials for any other share, and norms without an
identity ([Note: norms without an identity])."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from ragged_dtensor._private.fallback import RaggedOpError
from ragged_dtensor._private.ops_common import (
    _error,
    _first_ragged,
    _op_name,
    _with_meta,
    aten,
    has_ragged,
)
from ragged_dtensor._private.placement import (
    RaggedBoxView,
    RaggedNonEmptyView,
    RaggedPaddedView,
    RaggedShard,
)


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
