"""The policies and frozen value types of ``fully_shard`` (FSDP2's ``_fsdp_api``), and the
block-policy Protocol the engine owns.

Nothing of the engine's machinery is imported here; ``quantize`` is the pure arithmetic of the
quantized all-gather (no state), which ``QuantizedAllGather`` and ``QuantizedWeight`` need to
say which weights they choose and what a weight dequantizes to.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
import torch
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import DataParallelMeshDims  # FSDP2's own public type, re-exported
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy
from torch.distributed.tensor import DTensor

from fsdp_engine._private.quantize import (
    FORMATS,
    Format,
    dequantize_panel,
    panel_shape,
    scale_grid,
)

__all__ = [
    "QUANTIZABLE",
    "BlockPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "QuantizedAllGather",
    "QuantizedWeight",
    "callable_repr",
]


def callable_repr(value: object) -> str:
    """A callable's qualified name: reprs are compared across ranks (``fully_shard``'s agreement
    check), and a function's default repr holds its address, which differs per process."""
    if value is None:
        return "None"
    module = getattr(value, "__module__", None) or type(value).__module__
    name = getattr(value, "__qualname__", None) or type(value).__qualname__
    return f"<{module}.{name}>"


def _check_format(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if value not in FORMATS:
        raise ValueError(f"QuantizedAllGather.format must be one of {FORMATS}, got {value!r}")


def _as_block(value: object) -> tuple[int, int]:
    try:
        pair: tuple[Any, ...] = tuple(value)  # type: ignore[arg-type]
        if len(pair) != 2:
            raise ValueError
        block = (operator.index(pair[0]), operator.index(pair[1]))
    except (TypeError, ValueError):
        raise ValueError(
            f"QuantizedAllGather.block must be a pair of ints (rows, cols), got {value!r}"
        ) from None
    if min(block) < 1:
        raise ValueError(f"QuantizedAllGather.block must be positive, got {block}")
    return block


def _check_min_numel(instance: Any, attribute: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"QuantizedAllGather.min_numel must be an int >= 1, got {value!r}")


# the weight dtypes a quantized all-gather reads (float8 parameters travel as their own bytes)
QUANTIZABLE = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@attrs.frozen
class QuantizedWeight:
    """One weight as the quantized all-gather delivered it, before dequantization.

    ``codes``: the weight's shape, ``float8_e4m3fn`` or ``int8``; ``scales``: fp32, one per block
    of the matrix ``(prod(shape[:-1]), shape[-1])``, shape ``(ceil(rows / br), ceil(cols / bc))``;
    ``name``: the parameter's name relative to the module ``fully_shard`` was called on. For FP8
    GEMMs: ``w = codes.float() * scales`` expanded over each block.
    """

    name: str
    codes: torch.Tensor
    scales: torch.Tensor
    format: Format
    block: tuple[int, int]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the engine's parameters hold (bit for bit when ``dtype`` is the compute
        dtype)."""
        shape = tuple(self.codes.shape)
        rows, width = panel_shape(shape, self.block)
        grid = scale_grid(rows, width, self.block)
        out = dequantize_panel(
            self.codes.reshape(rows, width), self.scales.reshape(grid), self.block, dtype=dtype
        )
        return out.view(shape)


@attrs.frozen
class QuantizedAllGather:
    """Quantized weight communication for ``MixedPrecisionPolicy.quantized_all_gather``.

    Each group's all-gather carries blockwise-quantized weights: every rank quantizes the blocks
    of its own shard of the master weights, one collective moves the codes and scales of the
    whole group, and each weight is dequantized into the compute dtype (``param_dtype``) for
    forward and backward. Exact: the result equals quantize-then-dequantize of the full tensor,
    bit for bit (the planner never cuts a block row). Gradients, the reduce-scatter
    (``reduce_dtype``), master weights, optimizers and checkpoints are unchanged.

    Args:
        format: ``"float8_e4m3fn"`` (FP8 E4M3, |code| <= 448) or ``"int8"`` (|code| <= 127); one
            fp32 scale per block, ``amax / Q`` of the block.
        block: ``(rows, cols)`` of a block of the weight's matrix ``(prod(shape[:-1]),
            shape[-1])``: ``(128, 128)`` tiles (DeepSeek-V3's weight format) or ``(1, 128)``
            row blocks.
        min_numel: by default floating weights (fp32/bf16/fp16/fp64, not tensor-parallel
            DTensors) of at least 2 dims and ``min_numel`` elements whose rows are a multiple of
            the block's rows are quantized; the others (norms, biases, small tensors) travel in
            the compute dtype.
        filter: ``filter(name, param) -> bool`` replaces that default choice. A chosen weight
            whose rows are not a multiple of the block's rows is refused by name at
            ``fully_shard`` (a shard boundary would cut its partial last row of blocks).
        hook: ``hook(QuantizedWeight)`` is called for every quantized weight of a group when its
            all-gather completes, with its gathered codes and scales (e.g. for FP8 GEMMs).
    """

    format: Format = attrs.field(default="float8_e4m3fn", validator=_check_format)
    block: tuple[int, int] = attrs.field(default=(128, 128), converter=_as_block)
    min_numel: int = attrs.field(default=128 * 128, validator=_check_min_numel)
    filter: Callable[[str, torch.Tensor], bool] | None = attrs.field(
        default=None, repr=callable_repr
    )
    hook: Callable[[QuantizedWeight], None] | None = attrs.field(default=None, repr=callable_repr)

    def selects(self, name: str, param: torch.Tensor) -> bool:
        """Whether the weight ``name`` travels quantized (the default rule, or ``filter``)."""
        if self.filter is not None:
            return bool(self.filter(name, param))
        if isinstance(param, DTensor):  # tensor-parallel shards: not yet (see select_quantized)
            return False
        if param.dim() < 2 or param.numel() < self.min_numel or param.dtype not in QUANTIZABLE:
            return False
        rows, _ = panel_shape(tuple(param.shape), self.block)
        return rows % self.block[0] == 0


def _check_floating_or_none(name: str, value: object) -> None:
    if value is None:
        return
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(
            f"MixedPrecisionPolicy.{name} must be a floating dtype or None, got {value!r}"
        )


# [Note: FSDP2's policy classes]
# Ours subclass torch's (dataclasses, as torch's are): the same fields, defaults and
# frozen-ness, ``dataclasses.replace`` / ``asdict`` / ``fields`` work on them, and code that asks
# ``isinstance(policy, torch.distributed.fsdp.MixedPrecisionPolicy)`` accepts ours. fully_shard
# takes torch's own policies too (``check_mp_policy`` / ``check_offload_policy``).
@dataclasses.dataclass(frozen=True)
class MixedPrecisionPolicy(TorchMixedPrecisionPolicy):
    """Same fields and meaning as ``torch.distributed.fsdp.MixedPrecisionPolicy`` (a subclass
    of it, [Note: FSDP2's policy classes]).

    ``param_dtype``: dtype of the unsharded parameters used in forward/backward (the all-gather
    runs in it). ``reduce_dtype``: dtype of the gradient reduction (default: ``param_dtype``).
    ``output_dtype``: cast of floating outputs of the module. ``cast_forward_inputs``: cast floating
    inputs to ``param_dtype``. Unlike FSDP2, a dtype that is not floating is refused here,
    naming the field (FSDP2 fails later, or reduces gradients in integers).

    ``quantized_all_gather`` (ours, not FSDP2's): a ``QuantizedAllGather`` makes each group's
    all-gather carry blockwise FP8 / int8 codes and scales of its weight matrices, dequantized
    into ``param_dtype`` on arrival (the other parameters travel in ``param_dtype``); None: the
    all-gather moves ``param_dtype`` values.
    """

    quantized_all_gather: QuantizedAllGather | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            _check_floating_or_none(name, getattr(self, name))
        if self.quantized_all_gather is not None and not isinstance(
            self.quantized_all_gather, QuantizedAllGather
        ):
            raise TypeError(
                "MixedPrecisionPolicy.quantized_all_gather must be a QuantizedAllGather or None, "
                f"got {type(self.quantized_all_gather).__name__}"
            )


@dataclasses.dataclass
class OffloadPolicy(TorchOffloadPolicy):
    """No offloading (FSDP2's base ``OffloadPolicy``, a subclass of it)."""


@dataclasses.dataclass
class CPUOffloadPolicy(OffloadPolicy, TorchCPUOffloadPolicy):
    """Keep the sharded parameters, gradients and optimizer step on the CPU (a subclass of
    FSDP2's ``CPUOffloadPolicy``).

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
