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
"""

from __future__ import annotations

import math

import attrs
import torch

__all__ = ["AdamW8bitBlockPolicy", "MuonBlockPolicy"]


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
