"""The op-dispatch hooks of the DTensor integration (compat.py, parts 2, 3, 4 and 7 of its Note):
sharding propagation, the slow path (random ops, flattened row outputs, write-back), the
checkpoint protocol and torch's state-dict loader."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_dtensor._private import checkpoint, ops
from ragged_dtensor._private import random as ragged_random
from ragged_dtensor._private import state_dict as ragged_state_dict
from ragged_dtensor._private.compat_base import _spec_has_ragged, _torch_functions
from ragged_dtensor._private.compat_redistribute import _local_numel, _x_shape_of
from ragged_dtensor._private.fallback import (
    needs_write_back,
    write_back,
)
from ragged_dtensor._private.partial import (
    FILL_OPS,
    fill_on_partial,
    inplace_on_partial,
    scalar_of_partial,
)
from ragged_dtensor._private.rows import flatten_outputs

_CHECKPOINT_METHODS = {
    "__create_write_items__": ("self", "fqn", "object"),
    "__create_chunk_list__": ("self",),
    "__get_tensor_shard__": ("self", "index"),
}
_LAYOUT_FORMATS = (torch.channels_last, torch.channels_last_3d)


def _propagate_hook(op_schema: OpSchema) -> OutputSharding:
    originals = _torch_functions()
    if ops.schema_has_ragged(op_schema):
        return ops.propagate_ragged(
            op_schema, originals.tensor_meta, _local_numel, _x_shape_of, originals.propagate
        )
    scalar = scalar_of_partial(op_schema)  # [Note: a scalar read reduces a Partial]
    if scalar is not None:
        return scalar
    if op_schema.op in FILL_OPS:  # [Note: a fill never stays Partial]
        filled = fill_on_partial(op_schema, originals.tensor_meta)
        if filled is not None:
            return filled
    try:
        return originals.propagate(op_schema)
    except RuntimeError:
        reduced = inplace_on_partial(op_schema, originals.propagate)
        if reduced is None:
            raise
        return reduced


def _cut_share(full: torch.Tensor, spec: DTensorSpec) -> torch.Tensor:
    """This rank's share of a full-shape tensor laid out as ``spec`` (no communication)."""
    from ragged_dtensor._private.api import distribute_ragged

    placed = distribute_ragged(full, spec.mesh, spec.placements, src_data_rank=None)
    return placed.to_local()


def _slow_path_hook(op_call: torch._ops.OpOverload, args: tuple[object, ...], op_info: Any) -> Any:
    originals = _torch_functions()
    if op_info.local_kwargs.get("memory_format") in _LAYOUT_FORMATS:
        ops.ragged_memory_format(args, op_info)
    random = op_call in DTensor._op_dispatcher._random_ops or op_call in ops.RANDOM_OPS
    if random and ragged_random.is_ragged_random(op_call, args):
        return ragged_random.ragged_random_op(op_call, args, op_info, _cut_share)
    result = originals.slow_path(op_call, args, op_info)
    sharding = op_info.output_sharding
    if getattr(sharding, "_ragged_flatten", False):  # a row rule's boxes: flat shares
        return flatten_outputs(result, sharding)
    if needs_write_back(sharding):  # an in-place op's fallback
        write_back(args, op_info, _cut_share)
    return result


def _distribute_tensors_hook(
    local_state_dict: dict[str, Any], keys: list[str], device: torch.device, pg: Any = None
) -> None:
    ragged_state_dict.distribute_tensors_hook(
        _torch_functions().distribute_tensors, local_state_dict, keys, device, pg
    )


def _checkpoint_hook(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    table: dict[str, Callable[..., Any]] = {
        "__create_write_items__": checkpoint.create_write_items,
        "__create_chunk_list__": checkpoint.create_chunk_list,
        "__get_tensor_shard__": checkpoint.get_tensor_shard,
    }
    ragged = table[name]

    @functools.wraps(original)
    def method(self: DTensor, *args: Any) -> Any:
        if _spec_has_ragged(self._spec):
            return ragged(self, *args)
        return original(self, *args)

    return method
