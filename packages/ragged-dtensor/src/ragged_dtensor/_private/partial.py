"""Fill ops on a Partial DTensor: the constant is Replicate, never counted once per rank.

[Note: a fill never stays Partial]
A ragged reduction's result is a ``Partial`` DTensor (``x.sum(dim=1)`` of a share that is not
whole rows, ``x.sum()``, norms): each rank holds its partial value until something reads it.
torch 2.13's rules keep ``fill_`` and the value-setting ``*_like`` factories on a ``Partial``
operand ``Partial``: every rank then holds the constant, and reading it reduces the ranks'
copies (``Partial(sum)`` of ``fill_(1)`` reads as the world size). ``cosine_embedding_loss``
does exactly this (``empty_like`` + ``fill_(1)`` + ``sub_`` on a row-sum), and so gets wrong
values on a RaggedShard where ``Shard(0)`` of whole rows is right (and with ``Shard(1)`` in
torch itself).

A constant does not depend on the operand's values, so its right placement is ``Replicate``
on those mesh axes, with no communication. The propagator hook gives that for ``fill_`` and
``ones_like`` / ``full_like`` (and ``new_ones`` / ``new_full`` of the same shape) whenever an
operand is ``Partial`` with a reduction that does not leave the constant unchanged (sum,
product, p-norm partials; ``zero_``, ``zeros_like``, ``empty_like`` and the idempotent
reductions avg/max/min are already right and stay torch's). An in-place ``fill_`` changes its
operand's placement to ``Replicate`` (DTensor allows an in-place op to change the placement).
Every other op on a ``Partial`` keeps torch's own rule, which reduces before a non-linear op.

[Note: a scalar read reduces a Partial]
torch 2.13's sharding propagation skips ``aten._local_scalar_dense`` (``.item()``, ``float()``)
and runs it on the local tensor as it is: on a ``Partial`` that is this rank's partial value,
not the tensor's (``p.norm(2).item()`` of a ragged share gives the share's norm). Adafactor
takes its step size from exactly that, so every rank stepped with its own wrong ``alpha`` and
the result differed from one process's by ~5e-3 with no error. The hook reduces the operand to
``Replicate`` on its partial axes first (the value ``full_tensor()`` would give; one
all-reduce of one element), so every rank reads the tensor's value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

__all__ = ["FILL_OPS", "fill_on_partial", "inplace_on_partial", "scalar_of_partial"]

aten = torch.ops.aten

# op -> position of the fill value among the arguments (None: the value is 1)
FILL_OPS: dict[torch._ops.OpOverload, int | None] = {
    aten.fill_.Scalar: 1,
    aten.fill_.Tensor: 1,
    aten.fill.Scalar: 1,
    aten.fill.Tensor: 1,
    aten.ones_like.default: None,
    aten.full_like.default: 1,
    aten.new_ones.default: None,
    aten.new_full.default: 2,
}


def _changes_constant(placement: Placement, value: object) -> bool:
    """Whether reducing ``value`` held by every rank with this partial gives another value."""
    if not isinstance(placement, Partial):
        return False
    op = getattr(placement, "reduce_op", "sum")
    if type(placement) is not Partial:  # p-norm partials: v * world ** (1 / p)
        return not (isinstance(value, int | float) and value == 0)
    if op == "sum":
        return not (isinstance(value, int | float) and value == 0)
    if op == "product":
        return not (isinstance(value, int | float) and value in (0, 1))
    return False  # avg, max, min of equal values are the value


def fill_on_partial(
    schema: OpSchema, tensor_meta: Callable[[OpSchema], Any]
) -> OutputSharding | None:
    """Replicate for a fill of a Partial operand ([Note: a fill never stays Partial]), or None
    for torch's own rule."""
    position = FILL_OPS[schema.op]
    spec = schema.args_schema[0] if schema.args_schema else None
    if not isinstance(spec, DTensorSpec):
        return None
    value: object = 1
    if position is not None:
        value = (
            schema.args_schema[position]
            if len(schema.args_schema) > position
            else schema.kwargs_schema.get("fill_value", schema.kwargs_schema.get("value"))
        )
    if isinstance(value, DTensorSpec):
        value = None  # a tensor value: assume it changes
    if not any(_changes_constant(p, value) for p in spec.placements):
        return None
    if schema.op in (aten.new_ones.default, aten.new_full.default):
        size = schema.args_schema[1]
        assert isinstance(size, list | tuple)
        if [int(s) for s in size] != list(spec.shape):
            return None  # torch makes another shape Replicate already
    placements = tuple(Replicate() if p.is_partial() else p for p in spec.placements)
    for arg in schema.args_schema[1:]:
        if isinstance(arg, DTensorSpec) and any(p.is_partial() for p in arg.placements):
            return None  # a Partial fill value: torch's rule reduces it
    meta = tensor_meta(schema)
    assert isinstance(meta, TensorMeta)
    return OutputSharding(DTensorSpec(spec.mesh, placements, tensor_meta=meta))


def _first_operand_reduced(schema: OpSchema, spec: DTensorSpec) -> tuple[DTensorSpec, OpSchema]:
    """``spec`` (the first operand's) with its ``Partial`` axes ``Replicate``, and ``schema``
    asked with it: the op as it runs once the operand is reduced."""
    reduced = DTensorSpec(
        spec.mesh,
        tuple(Replicate() if p.is_partial() else p for p in spec.placements),
        tensor_meta=spec.tensor_meta,
    )
    asked = OpSchema(
        schema.op,
        (reduced, *schema.args_schema[1:]),
        schema.kwargs_schema,
        schema_info=schema.schema_info,
    )
    return reduced, asked


def inplace_on_partial(
    schema: OpSchema, torch_propagate: Callable[[OpSchema], OutputSharding]
) -> OutputSharding | None:
    """An in-place op on a ``Partial`` operand that torch refuses (``x.add_(eps)`` after a
    ragged mean with ``keepdim``: "in-place operations that require placement changes are not
    supported"): reduce first. The operand is all-reduced into a copy, the op runs on it, and
    the copy is written back (``fallback.write_back``): the operand becomes ``Replicate``.
    None when this does not apply (torch's error stands)."""
    from ragged_dtensor._private.fallback import FallbackSpec

    if not schema.is_inplace_op() or not schema.args_schema:
        return None
    spec = schema.args_schema[0]
    if not isinstance(spec, DTensorSpec) or not any(p.is_partial() for p in spec.placements):
        return None
    reduced, asked = _first_operand_reduced(schema, spec)
    result = torch_propagate(asked)
    target = result.redistribute_schema if result.needs_redistribute else asked
    if target is None or not isinstance(target.args_schema[0], DTensorSpec):
        return None
    wanted = target.args_schema[0]
    if wanted != reduced:
        return None
    marked = FallbackSpec(
        wanted.mesh,
        wanted.placements,
        tensor_meta=wanted.tensor_meta,
        op=str(schema.op),
        why="an in-place op on a Partial operand must reduce it first",
        writeback=True,
    )
    return OutputSharding(
        result.output_spec,
        redistribute_schema=OpSchema(
            target.op,
            (marked, *target.args_schema[1:]),
            target.kwargs_schema,
            schema_info=target.schema_info,
        ),
        needs_redistribute=True,
        use_val_from_redistribute_schema=result.use_val_from_redistribute_schema,
    )


def scalar_of_partial(schema: OpSchema) -> OutputSharding | None:
    """``_local_scalar_dense`` (``.item()``) of a ``Partial`` operand: reduce it first
    ([Note: a scalar read reduces a Partial]); None when the operand is not ``Partial``."""
    if schema.op is not aten._local_scalar_dense.default or not schema.args_schema:
        return None
    spec = schema.args_schema[0]
    if not isinstance(spec, DTensorSpec) or not any(p.is_partial() for p in spec.placements):
        return None
    _, asked = _first_operand_reduced(schema, spec)
    return OutputSharding(None, redistribute_schema=asked, needs_redistribute=True)
