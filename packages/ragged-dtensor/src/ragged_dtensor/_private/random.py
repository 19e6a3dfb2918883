"""Random ops on RaggedShard DTensors: the values one device draws with the same seed.

[Note: random init of ragged shards]
DTensor's RNG tracker (torch 2.13, accelerators only) offsets each shard's random stream for
``Shard``/``_StridedShard`` placements; for any other placement every rank would start at offset
0 and draw the first ``local_numel`` numbers of one stream (correlated shards), and on CPU there
is no tracker at all (each rank's local draw is unrelated to a single device's). A random op on
a ragged DTensor instead runs on a temporary of the full (global) shape with the generator the
op would use on one device (the device's default generator, or the ``generator=`` passed), and
each rank keeps its share. Every rank then consumes exactly what one device consumes, so with
the same seed on every rank (``torch.manual_seed``), meta-device init followed by
``reset_parameters()`` gives every parameter the values a single device gives, whatever the
layout, and every later draw stays in step.

[Note: the share only]
``uniform_`` and ``normal_`` (what ``nn.init`` uses) on a DTensor whose only non-replicated
axis is the ragged one (FSDP, HSDP) never build the full tensor: the rank's share is one flat
range of it, drawn by ``random_stream.draw_share`` chunk by chunk from a sequential generator
(CPU) or at its own offset of a counter-based one (CUDA's Philox), with the same values and the
same generator state afterwards (memory: the share plus one bounded chunk). Other random ops,
other layouts (a ``Shard`` on another axis) and other generators draw one temporary of the
tensor's full size per op and keep the share.

In-place fills (``uniform_``, ``normal_``, ``bernoulli_(p)``) and ``*_like`` factories are handled;
the other random ops of DTensor's list (dropout, ``bernoulli`` of a tensor of probabilities)
read values of the whole tensor and raise ``RaggedOpError`` on a ragged operand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Replicate
from torch.utils import _pytree as pytree

from ragged_dtensor._private import random_stream
from ragged_dtensor._private.ops import RANDOM_OPS, RaggedOpError, has_ragged
from ragged_dtensor._private.placement import RaggedShard

__all__ = ["LIKE_OPS", "ragged_random_op"]

aten = torch.ops.aten

INPLACE_OPS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float}
LIKE_OPS = RANDOM_OPS - INPLACE_OPS

Cut = Callable[[torch.Tensor, DTensorSpec], torch.Tensor]


def is_ragged_random(op_call: torch._ops.OpOverload, args: tuple[object, ...]) -> bool:
    first = args[0] if args else None
    return isinstance(first, DTensor) and has_ragged(first._spec)


def ragged_random_op(
    op_call: torch._ops.OpOverload, args: tuple[object, ...], op_info: Any, cut: Cut
) -> object:
    """The local result of random op ``op_call`` whose first operand is a ragged DTensor.

    ``cut(full, spec)`` returns this rank's share of a full-shape tensor laid out as ``spec``
    (no communication).
    """
    first = args[0]
    assert isinstance(first, DTensor)
    spec = first._spec
    local_args = (
        pytree.tree_unflatten(list(op_info.local_args), op_info.args_tree_spec)
        if op_info.args_tree_spec
        else op_info.local_args
    )
    kwargs = dict(op_info.local_kwargs)
    local = local_args[0]
    assert isinstance(local, torch.Tensor)
    if op_call not in INPLACE_OPS and op_call not in LIKE_OPS:
        raise RaggedOpError(
            f"{op_call} on a DTensor with placements {spec.placements}: this random op reads "
            "the whole tensor; redistribute to Replicate/Shard first"
        )
    if op_call in INPLACE_OPS:
        if local.is_meta:
            return op_call(*local_args, **kwargs)  # nothing to draw on meta
        share = _flat_share(spec)
        if share is not None and share[1] - share[0] == local.numel():
            numel = spec.shape.numel()
            rest = local_args[1:]
            if random_stream.draw_share(op_call, rest, kwargs, local, numel, share[0]):
                return local
        full = torch.empty(spec.shape, dtype=local.dtype, device=local.device)
        op_call(full, *local_args[1:], **kwargs)
        with torch.no_grad():
            local.copy_(cut(full, spec))
        return local
    dtype = kwargs.pop("dtype", None) or local.dtype
    device = kwargs.pop("device", None) or local.device
    kwargs.pop("layout", None)
    kwargs.pop("memory_format", None)
    if torch.device(device).type == "meta":
        return op_call(*local_args, dtype=dtype, device=device, **kwargs)
    template = torch.empty(spec.shape, dtype=local.dtype, device=device)
    full = op_call(template, *local_args[1:], dtype=dtype, **kwargs)
    return cut(full, spec).contiguous()


def _flat_share(spec: DTensorSpec) -> tuple[int, int] | None:
    """This rank's share as one flat range ``[start, stop)`` of the global tensor, when every
    axis but the ragged one replicates (module [Note: the share only]); else None."""
    shard = None
    for axis, placement in enumerate(spec.placements):
        if type(placement) is RaggedShard:
            shard = axis, placement
        elif not isinstance(placement, Replicate):
            return None
    if shard is None:
        return None
    axis, placement = shard
    flat = placement.flat_range(tuple(spec.shape), spec.mesh.get_local_rank(axis))
    return flat.start, flat.stop
