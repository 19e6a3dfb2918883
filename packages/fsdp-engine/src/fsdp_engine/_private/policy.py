"""Frozen policy value types (FSDP2's signatures) and the block-policy Protocol the engine owns."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import attrs
import torch

from fsdp_engine._private.quantized_gather import QuantizedAllGather

__all__ = ["BlockPolicy", "CPUOffloadPolicy", "MixedPrecisionPolicy", "OffloadPolicy"]


def _floating_or_none(
    instance: Any, attribute: attrs.Attribute[Any], value: torch.dtype | None
) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{attribute.name} must be a floating dtype or None, got {value!r}"
        )


@attrs.frozen
class MixedPrecisionPolicy:
    """Same fields and meaning as ``torch.distributed.fsdp.MixedPrecisionPolicy``.

    ``param_dtype``: dtype of the unsharded parameters used in forward/backward (the all-gather
    runs in it). ``reduce_dtype``: dtype of the gradient reduction (default: ``param_dtype``).
    ``output_dtype``: cast of floating outputs of the module. ``cast_forward_inputs``: cast floating
    inputs to ``param_dtype``.

    ``quantized_all_gather`` (ours, not FSDP2's): a ``QuantizedAllGather`` makes each group's
    all-gather carry blockwise FP8 / int8 codes and scales of its weight matrices, dequantized
    into ``param_dtype`` on arrival (the other parameters travel in ``param_dtype``); None: the
    all-gather moves ``param_dtype`` values.
    """

    param_dtype: torch.dtype | None = attrs.field(default=None, validator=_floating_or_none)
    reduce_dtype: torch.dtype | None = attrs.field(default=None, validator=_floating_or_none)
    output_dtype: torch.dtype | None = attrs.field(default=None, validator=_floating_or_none)
    cast_forward_inputs: bool = True
    quantized_all_gather: QuantizedAllGather | None = attrs.field(
        default=None,
        validator=attrs.validators.optional(attrs.validators.instance_of(QuantizedAllGather)),
    )


@attrs.frozen
class OffloadPolicy:
    """No offloading (FSDP2's base ``OffloadPolicy``)."""


@attrs.frozen
class CPUOffloadPolicy(OffloadPolicy):
    """Keep the sharded parameters, gradients and optimizer step on the CPU.

    ``pin_memory``: pin the CPU shards (for faster host-device copies on accelerators).
    """

    pin_memory: bool = True


@runtime_checkable
class BlockPolicy(Protocol):
    """Each parameter's atomic block in elements: no shard boundary may cut one.

    Called as ``policy(fqn, param)`` with the parameter's fully qualified name (relative to the
    module ``fully_shard`` is called on) and the parameter itself (its global shape). The result
    must divide ``param.numel()``; 1 means no constraint. Optimizers from ``optim_blockwise``
    provide such policies (an 8-bit Adam's quantization block, a matrix's row length...).
    """

    def __call__(self, name: str, param: torch.Tensor) -> int: ...
