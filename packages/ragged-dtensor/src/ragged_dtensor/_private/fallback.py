"""Ops without a ragged rule: redistribute the ragged operands, then torch's own rule.

[Note: the fallback redistribution]
DTensor runs an op whose operands are laid out differently from what its rule needs by
redistributing them first (e.g. ``Shard(0)`` operands of a matmul's right-hand side are
all-gathered). A RaggedShard operand of an op with no ragged rule gets the same treatment: the
placement is replaced by ``Replicate`` on its mesh axis (the other axes keep theirs), torch's own
sharding rule is asked about the op with those operands, and dispatch redistributes the ragged
operands to whatever that rule wants (one all-gather of the share per operand, through
``redistribute_local_tensor``). ``Replicate`` is the one target on which every rule of torch's
is right: a ``Shard(0)`` target would inherit torch's known wrong answers on uneven shards
(means as ``Partial("avg")``, convolutions, ``index_add_``); row-aligned shares of row-wise ops
have their own rule in ops.py, which moves nothing.

The cost stays visible:
- the redistribution's target spec is a ``FallbackSpec``, a ``DTensorSpec`` that names the op:
  the redistribute hook logs one debug line per redistributed operand (logger
  ``ragged_dtensor.fallback``) naming the op, the source and the target placements;
- strict mode (``set_strict(True)`` or ``with strict():``) makes that same hook raise
  ``RaggedOpError`` instead: code that must never communicate implicitly keeps a clear error.
  The check runs when the redistribution runs, not when the sharding is decided, so DTensor's
  sharding caches (per thread, C++ and Python) can never replay a decision made in the other
  mode.

Refused even without strict mode (``RaggedOpError``): in-place and ``out=`` ops whose written
operand is ragged (the op would write a temporary replicated copy, not the share).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor._private.placement import RaggedShard

__all__ = [
    "FallbackSpec",
    "RaggedOpError",
    "check_fallback",
    "is_strict",
    "needs_write_back",
    "propagate_fallback",
    "set_strict",
    "strict_mode",
    "write_back",
]

logger = logging.getLogger("ragged_dtensor.fallback")


class RaggedOpError(NotImplementedError):
    """An op that cannot be computed correctly on a RaggedShard operand, or (strict mode) one
    that would redistribute a ragged operand implicitly."""


_STATE_LOCK = threading.Lock()
# process-wide (autograd and rank threads see it too): the setting, and the open blocks
_STRICT = [False, 0]


def set_strict(enabled: bool) -> bool:
    """Strict mode on or off, process-wide; returns the previous setting.

    In strict mode an op with no ragged rule raises ``RaggedOpError`` instead of redistributing
    its ragged operands implicitly ([Note: the fallback redistribution]). ``strict_mode()``
    blocks are strict whatever this setting is.
    """
    with _STATE_LOCK:
        before = bool(_STRICT[0])
        _STRICT[0] = bool(enabled)
    return before


def is_strict() -> bool:
    """Whether strict mode is on (by ``set_strict(True)`` or an open ``strict_mode()``)."""
    return bool(_STRICT[0]) or int(_STRICT[1]) > 0


@contextlib.contextmanager
def strict_mode() -> Iterator[None]:
    """Strict mode for a block, process-wide while any such block is open (blocks on several
    threads nest: the mode ends with the last one)."""
    with _STATE_LOCK:
        _STRICT[1] = int(_STRICT[1]) + 1
    try:
        yield
    finally:
        with _STATE_LOCK:
            _STRICT[1] = int(_STRICT[1]) - 1


@dataclass
class FallbackSpec(DTensorSpec):
    """The target of a fallback redistribution: a ``DTensorSpec`` that also names the op
    (equal to, and hashed like, the plain spec; only the redistribute hook reads ``op``)."""

    op: str = field(default="", compare=False)
    why: str = field(default="", compare=False)
    writeback: bool = field(default=False, compare=False)

    def __hash__(self) -> int:  # dataclass(eq=True) would drop DTensorSpec's
        return DTensorSpec.__hash__(self)

    def __eq__(self, other: object) -> bool:
        return DTensorSpec.__eq__(self, other)


def check_fallback(current: DTensorSpec, target: FallbackSpec) -> None:
    """Called by the redistribute hook before a fallback redistribution: raise in strict
    mode, else log it."""
    if is_strict():
        raise RaggedOpError(
            f"{target.op} on a DTensor with placements {current.placements} (shape "
            f"{tuple(current.shape)}): {target.why}; strict mode refuses the implicit "
            f"redistribution {current.placements} -> {target.placements} (redistribute "
            f"explicitly, e.g. dt.redistribute(mesh, [Replicate()]), or leave strict mode)"
        )
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug(
            "%s: %s; redistributing an operand of shape %s %s -> %s",
            target.op,
            target.why,
            tuple(current.shape),
            _placements_str(current.placements),
            _placements_str(target.placements),
        )


def _placements_str(placements: tuple[Placement, ...]) -> str:
    return "(" + ", ".join(repr(p) for p in placements) + ")"


def _replicated(spec: DTensorSpec) -> DTensorSpec:
    placements = tuple(Replicate() if isinstance(p, RaggedShard) else p for p in spec.placements)
    return DTensorSpec(spec.mesh, placements, tensor_meta=spec.tensor_meta)


def _map_specs(value: object, fn: Any) -> object:
    if isinstance(value, DTensorSpec):
        return fn(value)
    if isinstance(value, list | tuple):
        return type(value)(_map_specs(v, fn) for v in value)
    return value


def _is_ragged(spec: object) -> bool:
    return isinstance(spec, DTensorSpec) and any(
        isinstance(p, RaggedShard) for p in spec.placements
    )


def _written_ragged(schema: OpSchema) -> list[int | str]:
    """The positions (or keyword names) of ragged operands the op writes (in-place self,
    ``out=`` tensors)."""
    found: list[int | str] = []
    for index, argument in enumerate(schema.op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        if argument.kwarg_only or index >= len(schema.args_schema):
            value = schema.kwargs_schema.get(argument.name)
            where: int | str = argument.name
        else:
            value = schema.args_schema[index]
            where = index
        if _is_ragged(value) or (
            isinstance(value, list | tuple) and any(_is_ragged(v) for v in value)
        ):
            found.append(where)
    return found


def _refuse(schema: OpSchema, why: str, what: str) -> RaggedOpError:
    first = next(
        s
        for s in torch.utils._pytree.tree_leaves((schema.args_schema, schema.kwargs_schema))
        if _is_ragged(s)
    )
    return RaggedOpError(
        f"{schema.op} on a DTensor with placements {first.placements} (shape "
        f"{tuple(first.shape)}): {why}; {what}"
    )


def propagate_fallback(
    schema: OpSchema,
    torch_propagate: Any,
    why: str,
) -> OutputSharding:
    """torch's sharding of ``schema`` with every ragged operand replaced by Replicate, whose
    redistribution targets are ``FallbackSpec``s ([Note: the fallback redistribution]).

    An in-place op whose written operand (``self``) is ragged runs on the replicated copy, and
    its share is written back into the ragged operand (``write_back``, from the slow path):
    the result keeps the operand's placement, as in place it must."""
    op = schema.op
    written = _written_ragged(schema)
    writeback = bool(written)
    if written and (written != [0] or not schema.is_inplace_op()):
        raise _refuse(
            schema,
            why,
            "it writes into a ragged out= operand, which cannot be redistributed for it: "
            "compute it out of place, or redistribute the tensor first",
        )
    if writeback:
        selves = schema.args_schema[0]
        for spec in selves if isinstance(selves, list | tuple) else [selves]:
            if isinstance(spec, DTensorSpec) and not all(
                isinstance(p, RaggedShard) or p.is_replicate() for p in spec.placements
            ):
                raise _refuse(
                    schema,
                    why,
                    f"it writes into a ragged operand placed {spec.placements} on several "
                    f"mesh axes: compute it out of place, or redistribute the tensor first",
                )
    for key, value in schema.kwargs_schema.items():
        # dispatch never redistributes keyword operands
        if _is_ragged(value) or (
            isinstance(value, list | tuple) and any(_is_ragged(v) for v in value)
        ):
            raise _refuse(
                schema, why, f"its keyword operand {key} is ragged: redistribute it first"
            )
    replaced = OpSchema(
        op,
        tuple(_map_specs(a, _replicated) for a in schema.args_schema),
        {k: _map_specs(v, _replicated) for k, v in schema.kwargs_schema.items()},
        schema_info=schema.schema_info,
    )
    try:
        result: OutputSharding = torch_propagate(replaced)
    except NotImplementedError:
        raise
    except Exception as exc:
        raise _refuse(
            schema,
            why,
            f"with its ragged operands replicated, torch's own sharding rule fails too: "
            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
        ) from exc
    target = result.redistribute_schema if result.needs_redistribute else None
    if target is None:
        target = replaced
    name = str(op)

    def mark(original: object, wanted: object, back: bool) -> object:
        if _is_ragged(original) and isinstance(wanted, DTensorSpec):
            return FallbackSpec(
                wanted.mesh,
                wanted.placements,
                tensor_meta=wanted.tensor_meta,
                op=name,
                why=why,
                writeback=back,
            )
        if isinstance(original, list | tuple) and isinstance(wanted, list | tuple):
            if len(original) != len(wanted):
                return wanted
            return type(wanted)(mark(o, w, back) for o, w in zip(original, wanted, strict=True))
        return wanted

    args = [
        mark(o, w, writeback and i == 0)
        for i, (o, w) in enumerate(zip(schema.args_schema, target.args_schema, strict=False))
    ]
    args += list(target.args_schema[len(args) :])
    marked = OpSchema(target.op, tuple(args), target.kwargs_schema, schema_info=target.schema_info)
    output = result.output_spec
    if writeback:
        self_spec = schema.args_schema[0]
        out_meta = getattr(output, "tensor_meta", None)
        if isinstance(self_spec, DTensorSpec) and (
            out_meta is None or tuple(out_meta.shape) != tuple(self_spec.shape)
        ):
            raise _refuse(
                schema,
                why,
                "it changes the ragged tensor's shape in place; use the out-of-place op",
            )
        output = _as_written(self_spec, output)
    return OutputSharding(
        output,
        redistribute_schema=marked,
        needs_redistribute=True,
        use_val_from_redistribute_schema=result.use_val_from_redistribute_schema,
    )


def _as_written(self_spec: object, output: Any) -> Any:
    """The output of an in-place op written back: the written operand's own placements."""
    if output is None:
        return None
    if isinstance(self_spec, DTensorSpec) and isinstance(output, DTensorSpec):
        return DTensorSpec(self_spec.mesh, self_spec.placements, tensor_meta=output.tensor_meta)
    if isinstance(self_spec, list | tuple) and isinstance(output, list | tuple):
        return type(output)(_as_written(s, o) for s, o in zip(self_spec, output, strict=True))
    return output


def needs_write_back(sharding: OutputSharding | None) -> bool:
    """Whether a dispatched op is an in-place fallback (checked after the slow path ran:
    cheap, the written operand is the first)."""
    if sharding is None or not sharding.needs_redistribute:
        return False
    schema = sharding.redistribute_schema
    if schema is None or not schema.args_schema:
        return False
    first = schema.args_schema[0]
    if isinstance(first, list | tuple):
        first = next((f for f in first if isinstance(f, FallbackSpec)), None)
    return isinstance(first, FallbackSpec) and first.writeback


def write_back(
    args: tuple[object, ...],
    op_info: Any,
    cut_share: Callable[[torch.Tensor, DTensorSpec], torch.Tensor],
) -> None:
    """Copy this rank's share of each written replicated copy into the ragged operand's local
    tensor (the in-place fallback's second half)."""
    selves = args[0]
    self_list = list(selves) if isinstance(selves, list | tuple) else [selves]
    locals_ = op_info.local_args
    written = list(locals_[: len(self_list)]) if isinstance(selves, list | tuple) else [locals_[0]]
    for dt, copy in zip(self_list, written, strict=True):
        spec = getattr(dt, "_spec", None)
        if spec is None:
            continue
        local = dt._local_tensor  # type: ignore[attr-defined]
        if _is_ragged(spec):
            local.copy_(cut_share(copy, spec))
        elif copy is not local:  # a reduced Partial ([Note: a fill never stays Partial])
            local.copy_(copy)
