"""Ragged rules that move nothing: reshapes of a flat share, and row-wise ops on whole rows.

[Note: a reshape keeps the flat range]
A ragged share is a contiguous range of the tensor's row-major storage, and a view or reshape
of a contiguous tensor keeps its row-major order: every rank's share is the same range of the
reshaped tensor. So ``view`` / ``reshape`` / ``_unsafe_view`` / ``flatten`` to any shape of the
same size keep the local tensor as it is (a view: it aliases), with a placement that cuts the
new shape at the same flat offsets: ``g`` = the gcd of every rank's boundaries (and the size)
is the unit; the shortest prefix of the new dims whose product is a multiple of the unit count
is ``dims`` (all dims always work). ``x.reshape(-1)``, ``w.view(B * T, C)`` and the views that
``linear`` on 3-D inputs makes cost nothing.

[Note: whole rows are Shard(0)]
When every rank's share is whole rows of dim 0 (``is_box``), the share is a ``Shard(0)``-like
block of rows (a different number per rank). For row-wise ops (a matrix product with the rows
on the left, softmax and layer norm over trailing dims, an embedding lookup by row-sharded
indices, and their backward ops) torch's ``Shard(0)`` rule computes each rank's rows from its
own rows alone, whatever their number: the rule is asked with the ragged operands as
``Shard(0)``, and accepted when it leaves them in place and every output is ``Shard(0)`` (rows:
ragged over dim 0 with the input's row counts), ``Replicate`` or ``Partial(sum)`` (a sum over
rows is right for any row counts; ``Partial(avg)`` would not be, and is refused). The ragged
operands are read as their boxes (``RaggedBoxView``): no communication, no copy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Partial, Placement, Shard

from ragged_dtensor._private.placement import RaggedBoxView, RaggedShard

__all__ = ["ROW_OPS", "flatten_outputs", "reshape_rule", "row_rule"]

aten = torch.ops.aten

ROW_OPS = {
    aten.mm.default,
    aten.addmm.default,
    aten._softmax.default,
    aten._log_softmax.default,
    aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default,
    aten.native_layer_norm.default,
    aten.native_layer_norm_backward.default,
    aten.embedding.default,
}


def _ragged_only_axis(spec: DTensorSpec) -> tuple[int, RaggedShard] | None:
    """(axis, placement) when the spec is ragged on one axis and replicated on the others."""
    found = None
    for axis, p in enumerate(spec.placements):
        if isinstance(p, RaggedShard):
            if type(p) is not RaggedShard or found is not None:
                return None
            found = (axis, p)
        elif not p.is_replicate():
            return None
    return found


def reshape_placement(
    old: RaggedShard, old_shape: tuple[int, ...], new_shape: tuple[int, ...]
) -> RaggedShard | None:
    """The placement of ``new_shape`` that cuts the same flat ranges ([Note: a reshape keeps
    the flat range]); None for a 0-d result or a size mismatch."""
    numel = math.prod(old_shape)
    if not new_shape or math.prod(new_shape) != numel or numel == 0:
        return None
    sizes = [old.local_numel(old_shape, k) for k in range(len(old.local_units))]
    unit = numel
    for size in sizes:
        unit = math.gcd(unit, size)
    units = tuple(size // unit for size in sizes)
    count = numel // unit
    for k in range(1, len(new_shape) + 1):
        if math.prod(new_shape[:k]) % count == 0:
            return RaggedShard(tuple(range(k)), units)
    return None  # unreachable: the product of every dim is numel, a multiple of count


_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def reshape_rule(
    schema: OpSchema, meta: object, local_numel: Callable[[DTensorSpec], int]
) -> OutputSharding | None:
    """A view/reshape of a ragged tensor to another shape of the same size: the same local
    tensor, re-cut ([Note: a reshape keeps the flat range]); None when it does not apply."""
    if schema.op not in _RESHAPES or not isinstance(meta, TensorMeta):
        return None
    spec = schema.args_schema[0]
    assert isinstance(spec, DTensorSpec)
    found = _ragged_only_axis(spec)
    if found is None:
        return None
    axis, placement = found
    new = reshape_placement(placement, tuple(spec.shape), tuple(meta.shape))
    if new is None:
        return None
    placements = list(spec.placements)
    placements[axis] = new
    args = list(schema.args_schema)
    args[1] = [local_numel(spec)]
    return OutputSharding(
        DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta),
        redistribute_schema=OpSchema(
            schema.op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info
        ),
        needs_redistribute=True,
        use_val_from_redistribute_schema=True,
    )


def _as(spec: DTensorSpec, axis: int, placement: Placement) -> DTensorSpec:
    placements = list(spec.placements)
    placements[axis] = placement
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)


def _map(value: object, fn: Callable[[object], object]) -> object:
    if isinstance(value, list | tuple) and not isinstance(value, torch.Size):
        return type(value)(_map(v, fn) for v in value)
    return fn(value)


def row_rule(
    schema: OpSchema, torch_propagate: Callable[[OpSchema], OutputSharding]
) -> OutputSharding | None:
    """Row-wise ops on whole-row shares as torch's Shard(0) rule ([Note: whole rows are
    Shard(0)]); None when it does not apply."""
    if schema.op not in ROW_OPS:
        return None
    layout: tuple[int, RaggedShard, int] | None = None  # axis, placement, rows
    shape: tuple[int, ...] = ()
    for arg in schema.args_schema:
        if not (
            isinstance(arg, DTensorSpec) and any(isinstance(p, RaggedShard) for p in arg.placements)
        ):
            continue
        found = _ragged_only_axis(arg)
        if found is None or not found[1].is_box(tuple(arg.shape)) or arg.ndim == 0:
            return None
        here = (found[0], found[1], int(arg.shape[0]))
        if layout is not None and here != layout:
            return None
        layout, shape = here, tuple(arg.shape)
    if layout is None or math.prod(shape[1:]) == 0:
        return None
    axis, placement, rows = layout
    for arg in torch.utils._pytree.tree_leaves(schema.args_schema):
        # other DTensor operands replicated: a Shard operand's rows would be torch's chunks
        if (
            isinstance(arg, DTensorSpec)
            and not any(isinstance(p, RaggedShard) for p in arg.placements)
            and not all(p.is_replicate() for p in arg.placements)
        ):
            return None
    shard0 = Shard(0)

    def as_shard(value: object) -> object:
        if isinstance(value, DTensorSpec) and isinstance(value.placements[axis], RaggedShard):
            return _as(value, axis, shard0)
        return value

    asked = OpSchema(
        schema.op,
        tuple(_map(a, as_shard) for a in schema.args_schema),
        schema.kwargs_schema,
        schema_info=schema.schema_info,
    )
    try:
        result = torch_propagate(asked)
    except Exception:
        return None
    target = result.redistribute_schema if result.needs_redistribute else asked
    if target is None or target.op is not schema.op:
        return None
    row = math.prod(shape[1:])
    row_counts = tuple(
        placement.local_numel(shape, k) // max(row, 1) for k in range(len(placement.local_units))
    )
    view = RaggedBoxView(placement.dims, placement.local_units)
    args: list[object] = []
    for original, wanted in zip(schema.args_schema, target.args_schema, strict=True):
        if isinstance(original, DTensorSpec) and isinstance(original.placements[axis], RaggedShard):
            if wanted != as_shard(original):
                return None  # torch would move the rows
            args.append(_as(original, axis, view))
        elif isinstance(original, DTensorSpec) and wanted != original:
            return None  # torch would move another operand (e.g. a Shard(1) left-hand side)
        else:
            args.append(wanted)
    out = _outputs(result.output_spec, axis, rows, RaggedShard((0,), row_counts))
    if out is _REFUSED:
        return None
    sharding = OutputSharding(
        out,
        redistribute_schema=OpSchema(
            schema.op, tuple(args), schema.kwargs_schema, schema_info=schema.schema_info
        ),
        needs_redistribute=True,
    )
    # the op's local results are boxes; a ragged local tensor is flat (flatten_outputs)
    sharding._ragged_flatten = True  # type: ignore[attr-defined]
    return sharding


def flatten_outputs(result: Any, sharding: OutputSharding) -> Any:
    """The local results of a row rule with each ragged output flattened (a view)."""
    spec: Any = sharding.output_spec
    if isinstance(spec, DTensorSpec):
        ragged = any(isinstance(p, RaggedShard) for p in spec.placements)
        return result.reshape(-1) if ragged and isinstance(result, torch.Tensor) else result
    if isinstance(spec, list | tuple) and isinstance(result, list | tuple):
        return type(result)(
            r.reshape(-1)
            if isinstance(s, DTensorSpec)
            and isinstance(r, torch.Tensor)
            and any(isinstance(p, RaggedShard) for p in s.placements)
            else r
            for r, s in zip(result, spec, strict=True)
        )
    return result


_REFUSED = object()


def _outputs(value: Any, axis: int, rows: int, ragged: RaggedShard) -> Any:
    if value is None:
        return None
    if isinstance(value, list | tuple):
        mapped = [_outputs(v, axis, rows, ragged) for v in value]
        return _REFUSED if any(m is _REFUSED for m in mapped) else type(value)(mapped)
    assert isinstance(value, DTensorSpec)
    p = value.placements[axis]
    if p.is_replicate():
        return value
    if isinstance(p, Partial) and type(p) is Partial and p.reduce_op == "sum":
        return value
    if p.is_shard(0) and value.ndim > 0 and value.shape[0] == rows:
        if any(not q.is_replicate() for a, q in enumerate(value.placements) if a != axis):
            return _REFUSED
        return _as(value, axis, ragged)
    return _REFUSED
