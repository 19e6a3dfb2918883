"""Shared pieces of the fine-tuning tests (``nox -s finetune``, ``tests/test_finetune_*.py``):
a QLoRA model (frozen NF4 base weights from torchao, trainable LoRA adapters), its training
run on either engine, and the collective bytes each step moves.

The model: ``blocks`` of two LoRA linears (``up``: 64 -> 256, ``down``: 256 -> 64) whose base
weights are torchao ``NF4Tensor`` parameters (4-bit codes in blocks of 64, scales quantized in
blocks of 64 so every inner tensor splits over 1, 2 and 4 ranks), frozen; the adapters
``lora_a`` (r x in) and ``lora_b`` (out x r) in bf16, trainable (``lora_b`` starts at small
random values instead of zeros, so every gradient is non-zero from the first step); a frozen
plain bf16 ``head`` in the root's group. Everything computes in bf16.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "DIM",
    "QLoRA",
    "adapter_names",
    "batch",
    "build_qlora",
    "engine",
    "inner_values",
    "shard_qlora",
]

DIM, HIDDEN, RANK = 64, 256, 8
_BUILD = threading.Lock()  # threaded ranks share torch's generator


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    from torchao.quantization import to_nf4

    return to_nf4(weight, block_size=64, scaler_block_size=64)


class LoRALinear(nn.Module):
    """``x @ W^T + scale * (x @ A^T) @ B^T`` with ``W`` a frozen NF4 parameter."""

    def __init__(self, into: int, out: int, generator: torch.Generator) -> None:
        super().__init__()
        base = torch.randn(out, into, generator=generator, dtype=torch.float32) / into**0.5
        self.weight = nn.Parameter(_nf4(base.to(torch.bfloat16)), requires_grad=False)
        a = torch.randn(RANK, into, generator=generator) / into**0.5
        b = torch.randn(out, RANK, generator=generator) * 0.01
        self.lora_a = nn.Parameter(a.to(torch.bfloat16))
        self.lora_b = nn.Parameter(b.to(torch.bfloat16))
        self.scale = 2.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) + self.scale * F.linear(
            F.linear(x, self.lora_a), self.lora_b
        )


class Block(nn.Module):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.up = LoRALinear(DIM, HIDDEN, generator)
        self.down = LoRALinear(HIDDEN, DIM, generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.up(x)))


class QLoRA(nn.Module):
    def __init__(self, n_blocks: int = 2, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(Block(generator) for _ in range(n_blocks))
        head = torch.randn(16, DIM, generator=generator) / DIM**0.5
        self.head = nn.Parameter(head.to(torch.bfloat16), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.head)


def build_qlora(n_blocks: int = 2, seed: int = 0) -> QLoRA:
    with _BUILD:
        return QLoRA(n_blocks, seed)


def shard_qlora(api: Any, model: QLoRA, mesh: Any, **kwargs: Any) -> None:
    """``fully_shard`` per block, then the root (either engine's module)."""
    for block in model.blocks:
        api.fully_shard(block, mesh=mesh, **kwargs)
    api.fully_shard(model, mesh=mesh, **kwargs)


def adapter_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def inner_values(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor's bytes: itself, or an NF4 tensor's codes and scales (its inner tensors)."""
    if type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return [getattr(tensor, n).detach().clone() for n in names]
    return [tensor.detach().clone()]


def engine(name: str) -> Any:
    """``"ours"``: fsdp_engine; ``"fsdp2"``: torch.distributed.fsdp (the control)."""
    if name == "ours":
        import fsdp_engine

        return fsdp_engine
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp


def batch(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, DIM, generator=g).to(torch.bfloat16)
