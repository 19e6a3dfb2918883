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

This module applies the rules in order (``propagate_ragged``) and holds the view and factory
rule; the op tables are in ops_common.py, the elementwise rule in ops_elementwise.py and the
reductions in ops_reductions.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Replicate

from ragged_dtensor._private.fallback import RaggedOpError, propagate_fallback
from ragged_dtensor._private.ops_common import (
    RANDOM_OPS,
    _error,
    _is_elementwise,
    _schema_has_ragged,
    _with_meta,
    aten,
    has_ragged,
)
from ragged_dtensor._private.ops_elementwise import (
    _elementwise,
    _memory_format,
    ragged_memory_format,
)
from ragged_dtensor._private.ops_reductions import (
    _reduction,
    _rowwise,
)
from ragged_dtensor._private.rows import reshape_rule, row_rule

__all__ = [
    "RANDOM_OPS",
    "RaggedOpError",
    "has_ragged",
    "propagate_ragged",
    "ragged_memory_format",
    "schema_has_ragged",
]

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
