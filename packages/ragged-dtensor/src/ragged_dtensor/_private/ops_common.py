"""What the ragged sharding rules share (ops.py applies them): the op tables and classification
(elementwise, random), and the helpers that name a ragged operand or build an output spec."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._op_schema import OpSchema
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private.fallback import RaggedOpError
from ragged_dtensor._private.placement import (
    RaggedShard,
)

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
