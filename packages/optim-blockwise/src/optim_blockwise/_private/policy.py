"""Block policies: the atomic block (in elements) each optimizer needs a shard boundary to respect.

[Note: the block-policy protocol]
A sharding engine (fsdp-engine) owns a protocol of the form
``(name: str, param: torch.Tensor) -> int``: the returned number of elements must divide the
parameter's numel, and the engine then never puts a rank boundary strictly inside such a block.
The values here satisfy it structurally (this package never imports the engine).

- 8-bit AdamW: its quantization block, so each rank quantizes its own shard with no exchange and
  bit-identical results. A tensor below the 8-bit threshold keeps fp32 state: no constraint (1).
  A tensor whose numel is not a multiple of the block has a short last block (the quantization
  handles it like any block). The protocol needs a divisor of numel, and no multiple of the
  block divides such a numel, so the policy returns ``gcd(numel, block)``: shard boundaries fall
  on multiples of it, the tensor is spread over the ranks like any other (never one block, never
  forced onto one rank), and a boundary that cuts a quantization block costs the exchange of a
  few partial absmaxes per step (``AdamW8bit`` handles unaligned shards exactly, bit for bit).
- Muon: no constraint by default (1). Its root gathers a matrix from arbitrary flat ranges, so
  cutting rows costs nothing; ``row_aligned=True`` returns the row length (no row cut), for
  engines that want every shard to be a box of whole rows.

[Note: AdamW8bit and the block policy must agree]
The policy given to the engine and the optimizer's own settings describe one thing, the
quantization blocks, in two places. If they differ (``block_policy(block_size=64)`` for the
engine, ``AdamW8bit(block_size=128)``; or a policy ``min_8bit_size`` above the optimizer's, so
tensors the optimizer keeps in 8 bits are unconstrained), shard boundaries cut quantization
blocks: training stays exact (the edge absmaxes are exchanged) but a checkpoint of that 8-bit
state loads only into the layout it was saved from. So, at construction:

- compatibility, per tensor: settings ``(block_size=B, min_8bit_size=M)`` are compatible with a
  policy when, for every tensor the optimizer keeps in 8 bits (``numel >= M``), the policy's
  block for it is a multiple of ``gcd(numel, B)`` (the block ``AdamW8bit.block_policy`` gives
  it): every boundary the policy allows is one the optimizer's own policy allows, so no shard
  cuts a quantization block and the 8-bit state is the same in every layout. For an
  ``AdamW8bitBlockPolicy(Bp, Mp)`` that is: the tensor has ``numel >= Mp`` and
  ``gcd(numel, B)`` divides ``gcd(numel, Bp)``; ``B`` dividing ``Bp`` with ``M >= Mp`` is
  compatible for every tensor (``block_size=32`` under a 64-element policy);
- ``AdamW8bit(..., block_policy=policy)`` takes its settings from an ``AdamW8bitBlockPolicy``;
  a ``block_size`` / ``min_8bit_size`` also given that differs is used when compatible, and
  refused naming both values and the first tensor it is not compatible for otherwise;
- any other policy callable must be compatible the same way (e.g. an LCM of several
  optimizers' policies); otherwise it is refused, naming the tensor and both blocks;
- with a policy given, a sharded parameter whose layout cuts those blocks anyway was sharded
  with another policy: refused, naming the boundary;
- a parameter may carry the policy it was sharded with as ``param.block_policy`` (fsdp-engine
  records the one given to ``fully_shard`` on every sharded parameter of a planned group: it
  hands the optimizer nothing but the parameters). An ``AdamW8bitBlockPolicy`` recorded there
  that is not compatible with the optimizer's settings for that parameter is refused, naming
  both values, whether or not the optimizer was given a policy;
- with no policy given or recorded, a ``RaggedShard`` layout that cuts the blocks an agreeing
  policy keeps whole is reported with a warning naming the parameter, the boundary and the
  policy to use (an engine without a block policy, or FSDP2's ``Shard(0)``, cuts blocks by
  design).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import attrs
import torch

from optim_blockwise._private.layout import ParamLayout

__all__ = [
    "AdamW8bitBlockPolicy",
    "MuonBlockPolicy",
    "BlockPolicy",
    "adamw8bit_settings",
    "check_adamw8bit_blocks",
    "check_recorded_policy",
    "RECORDED_POLICY_ATTR",
]

RECORDED_POLICY_ATTR = "block_policy"
"""The attribute of a sharded parameter holding the block policy it was sharded with."""

BlockPolicy = Callable[[str, torch.Tensor], int]
"""The engine's protocol: ``(name, param) -> elements`` of a block no shard boundary cuts."""


@attrs.frozen
class AdamW8bitBlockPolicy:
    """Block requirement of ``AdamW8bit``: its quantization block for 8-bit-state tensors."""

    block_size: int = 256
    min_8bit_size: int = 4096

    def __attrs_post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")

    def __call__(self, name: str, param: torch.Tensor) -> int:
        numel = math.prod(param.shape)
        if numel < self.min_8bit_size or numel == 0:
            return 1
        return math.gcd(numel, self.block_size)


@attrs.frozen
class MuonBlockPolicy:
    """Block requirement of ``Muon``: none (1), or whole rows with ``row_aligned=True``."""

    row_aligned: bool = False

    def __call__(self, name: str, param: torch.Tensor) -> int:
        if not self.row_aligned or param.dim() < 2 or math.prod(param.shape) == 0:
            return 1
        return math.prod(param.shape[1:])


def adamw8bit_settings(
    block_size: int | None, min_8bit_size: int | None, policy: BlockPolicy | None
) -> tuple[int, int]:
    """``AdamW8bit``'s ``(block_size, min_8bit_size)``: as given, else the ``policy``'s (an
    ``AdamW8bitBlockPolicy``), else the defaults. A given setting that differs from the
    policy's is checked per tensor (``check_adamw8bit_blocks``: compatible, or refused naming
    both values)."""
    default = policy if isinstance(policy, AdamW8bitBlockPolicy) else AdamW8bitBlockPolicy()
    return (
        default.block_size if block_size is None else block_size,
        default.min_8bit_size if min_8bit_size is None else min_8bit_size,
    )


def _differences(
    policy: AdamW8bitBlockPolicy, block_size: int, min_8bit_size: int
) -> tuple[str, str]:
    """``AdamW8bit(ours) ... (theirs)``: the settings that differ from the policy's."""
    mine = {"block_size": block_size, "min_8bit_size": min_8bit_size}
    differ = {k: v for k, v in mine.items() if v != getattr(policy, k)}
    ours = ", ".join(f"{k}={v}" for k, v in differ.items())
    return ours, ", ".join(f"{k}={getattr(policy, k)}" for k in differ)


def _incompatible(
    name: str, param: torch.Tensor, policy: BlockPolicy, block_size: int, min_8bit_size: int
) -> tuple[int, int, int] | None:
    """``(numel, policy's block, block needed)`` when ``policy`` is not compatible with the
    settings for ``param`` (the agreement note: the policy's block must be a multiple of
    ``gcd(numel, block_size)`` for a tensor kept in 8 bits), else ``None``."""
    numel = math.prod(param.shape)
    if numel == 0 or numel < min_8bit_size:
        return None  # fp32 state: no block to keep whole
    need = math.gcd(numel, block_size)
    given = operator.index(policy(name, param))
    if given >= 1 and given % need == 0:
        return None
    return numel, given, need


def check_recorded_policy(
    name: str, param: torch.Tensor, block_size: int, min_8bit_size: int
) -> None:
    """Refuse (``ValueError`` naming both values) an ``AdamW8bitBlockPolicy`` recorded on
    ``param`` (``param.block_policy``, the agreement note) that is not compatible with the
    optimizer's ``block_size`` / ``min_8bit_size`` for it."""
    recorded = getattr(param, RECORDED_POLICY_ATTR, None)
    if not isinstance(recorded, AdamW8bitBlockPolicy):
        return
    bad = _incompatible(name, param, recorded, block_size, min_8bit_size)
    if bad is None:
        return
    numel, given, need = bad
    ours, theirs = _differences(recorded, block_size, min_8bit_size)
    raise ValueError(
        f"AdamW8bit({ours}) disagrees with the block policy parameter {name!r} was sharded "
        f"with, {recorded!r} ({theirs}), recorded on it by the sharding engine (fully_shard's "
        f"block_policy): it gave the parameter ({numel} elements) blocks of {given} elements, "
        f"but the optimizer keeps it in 8 bits in quantization blocks that need shard "
        f"boundaries on multiples of {need}, so shard boundaries cut quantization blocks and "
        f"a checkpoint of the 8-bit state loads only into the layout it was saved from. Use "
        f"compatible settings (a block_size dividing the policy's, a min_8bit_size at least "
        f"the policy's) or the same ones: AdamW8bit(..., block_policy=policy) takes them from "
        f"the policy"
    )


def _first_cut(layout: ParamLayout, block: int) -> int | None:
    """The first rank boundary of ``layout`` strictly inside a block of ``block`` elements."""
    for lo, hi in layout.ranges:
        if hi > lo and lo % block:
            return lo
    return None


def check_adamw8bit_blocks(
    name: str,
    param: torch.Tensor,
    layout: ParamLayout | None,
    block_size: int,
    min_8bit_size: int,
    policy: BlockPolicy | None,
) -> str | None:
    """Check one parameter against the agreement note. Raises ``ValueError`` when ``policy``
    (given to the optimizer) disagrees with the optimizer's blocks for it, or its ``layout``
    (``None``: not checked) cuts them despite the policy; returns a warning's text when no policy
    was given and the layout cuts them; else ``None``."""
    numel = math.prod(param.shape)
    if numel == 0 or numel < min_8bit_size:
        return None  # fp32 state: no block to keep whole
    need = math.gcd(numel, block_size)  # what AdamW8bit.block_policy asks for
    settings = f"AdamW8bit(block_size={block_size}, min_8bit_size={min_8bit_size})"
    bad = None if policy is None else _incompatible(name, param, policy, block_size, min_8bit_size)
    if bad is not None and isinstance(policy, AdamW8bitBlockPolicy):
        ours, theirs = _differences(policy, block_size, min_8bit_size)
        raise ValueError(
            f"AdamW8bit({ours}) disagrees with its block_policy={policy!r} ({theirs}) for "
            f"parameter {name!r} ({numel} elements): the policy gives it blocks of {bad[1]} "
            f"elements, but the optimizer keeps it in 8 bits in quantization blocks that need "
            f"shard boundaries on multiples of {need}, so shard boundaries cut quantization "
            f"blocks and a checkpoint of the 8-bit state loads only into the layout it was "
            f"saved from. Settings compatible with the policy (a block_size dividing its "
            f"block_size, a min_8bit_size at least its min_8bit_size) are accepted; or pass "
            f"the policy alone: AdamW8bit(..., block_policy=policy) takes its settings from it"
        )
    if bad is not None:
        raise ValueError(
            f"parameter {name!r} ({numel} elements): block_policy={policy!r} gives it "
            f"blocks of {bad[1]} elements, but {settings} keeps it in 8 bits in quantization "
            f"blocks that need shard boundaries on multiples of {need}: the policy must "
            f"give it a multiple of {need} (e.g. the math.lcm of the policies, one of them "
            f"AdamW8bit.block_policy(block_size={block_size}, "
            f"min_8bit_size={min_8bit_size}))"
        )
    if layout is None:
        return None
    cut = _first_cut(layout, need)
    if cut is None:
        return None
    where = (
        f"parameter {name!r} is sharded with a rank boundary at element {cut} "
        f"({layout.placement}), inside one of its quantization blocks ({settings} keeps them "
        f"whole with boundaries on multiples of {need})"
    )
    if policy is not None:
        raise ValueError(
            f"{where}, which block_policy={policy!r} keeps whole: the parameters were sharded "
            f"with another block policy than the optimizer's; give fully_shard the same one"
        )
    return (
        f"AdamW8bit: {where}. The step exchanges the edge absmaxes (exact), but a checkpoint "
        f"of this 8-bit state loads only into this same layout. The parameters were sharded "
        f"without a block policy or with one that disagrees with the optimizer: give fully_shard "
        f"AdamW8bit.block_policy(block_size={block_size}, min_8bit_size={min_8bit_size}), and "
        f"the same policy to AdamW8bit(..., block_policy=policy) to have any disagreement "
        f"refused at construction"
    )
