"""DTensor's custom op handlers, for ragged operands: redistribute first.

[Note: ops DTensor handles by hand]
A few aten ops never reach DTensor's sharding propagation: the dispatcher runs a handler of its
own (``DTensor._op_dispatcher._custom_op_handlers``). ``argmin`` / ``argmax`` combine the
ranks' local indices for ``Shard`` placements only, so a ragged operand (``is_shard()`` is
False) would return the local index of a share as if it were the global one; ``convolution``
and its backward and ``as_strided`` reach the flat local share with the global weights'
geometry. So the integration wraps exactly these entries of that dict (checked, reversible,
like every other part): a ragged operand is redistributed to ``Replicate`` on its ragged axis
first, as the fallback does for an op without a rule ([Note: the fallback redistribution],
strict mode refuses, the debug log names it), then torch's handler runs unchanged. Every
other call goes to torch's handler directly. (The AMP handler,
``_amp_foreach_non_finite_check_and_unscale_``, already reduces ``found_inf`` over every
non-Replicate axis, ragged ones included: it is left alone.)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate
from torch.utils import _pytree as pytree

from ragged_dtensor._private.fallback import FallbackSpec, RaggedOpError, check_fallback
from ragged_dtensor._private.placement import RaggedShard

__all__ = ["HANDLED", "handler_changes"]

aten = torch.ops.aten
HANDLED = (
    aten.argmin.default,
    aten.argmax.default,
    aten.convolution.default,
    aten.convolution_backward.default,
    aten.as_strided.default,
)


def _is_ragged(value: object) -> bool:
    return isinstance(value, DTensor) and any(
        isinstance(p, RaggedShard) for p in value._spec.placements
    )


def _replicated(op: torch._ops.OpOverload, value: object) -> object:
    if not _is_ragged(value):
        return value
    assert isinstance(value, DTensor)
    spec = value._spec
    placements = tuple(Replicate() if isinstance(p, RaggedShard) else p for p in spec.placements)
    check_fallback(
        spec,
        FallbackSpec(
            spec.mesh,
            placements,
            tensor_meta=spec.tensor_meta,
            op=str(op),
            why="DTensor handles this op by hand, for Shard/Replicate/Partial operands only",
        ),
    )
    return value.redistribute(value.device_mesh, placements)


def _wrap(op: torch._ops.OpOverload, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def handler(op_call: torch._ops.OpOverload, args: Any, kwargs: Any) -> Any:
        leaves = pytree.tree_leaves((args, kwargs))
        if any(_is_ragged(leaf) for leaf in leaves):
            if op_call is aten.as_strided.default:
                first = next(leaf for leaf in leaves if _is_ragged(leaf))
                raise RaggedOpError(
                    f"{op_call} on a DTensor with placements {first.placements} (shape "
                    f"{tuple(first.shape)}): strides of a flat share mean nothing, and DTensor "
                    f"supports as_strided on no placement; use view/reshape, or redistribute "
                    f"and call it on the local tensor"
                )
            args, kwargs = pytree.tree_map(lambda v: _replicated(op_call, v), (args, kwargs))
        return original(op_call, args, kwargs)

    handler._ragged_dtensor_handler = True  # type: ignore[attr-defined]
    return handler


@attrs.frozen
class ItemChange:
    """One entry of a dict the integration sets (a custom op handler): the value found, ours."""

    owner: dict[Any, Any]
    key: Any
    where: str
    found: Any
    ours: Any

    @property
    def name(self) -> str:
        return f"custom_op_handler:{self.key}"

    def apply(self) -> None:
        self.owner[self.key] = self.ours

    def still_ours(self) -> bool:
        return self.owner.get(self.key) is self.ours

    def undo(self) -> None:
        self.owner[self.key] = self.found


def handler_changes(refusing: str, error: type[Exception]) -> list[ItemChange]:
    """The wrapped handlers ([Note: ops DTensor handles by hand]); raise ``error`` naming the
    entry if one is missing or is not torch's function."""
    table = DTensor._op_dispatcher._custom_op_handlers
    changes = []
    for op in HANDLED:
        where = f"DTensor._op_dispatcher._custom_op_handlers[{op}]"
        found = table.get(op)
        module = getattr(found, "__module__", "") or ""
        if found is None or not module.startswith("torch.") or hasattr(found, "__wrapped__"):
            raise error(f"ragged_dtensor: {where} is not torch's handler but {found!r}. {refusing}")
        changes.append(ItemChange(table, op, where, found, _wrap(op, found)))
    return changes
