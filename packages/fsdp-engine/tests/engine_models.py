"""A small LLaMA-like decoder for tests (written here; no download)."""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.ffn_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(
        self, vocab: int = 97, dim: int = 32, layers: int = 2, heads: int = 4, ffn: int = 48
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=True)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# Threaded ranks share torch's global generator: constructing a model draws from it, so every
# construction (and the seeded one that makes the reference weights) happens under this lock.
RNG_LOCK = threading.RLock()


def build(**kwargs: int) -> TinyLlama:
    """A TinyLlama whose construction does not race other threads' seeded constructions."""
    with RNG_LOCK:
        return TinyLlama(**kwargs)


def batches(
    steps: int, world: int, batch: int = 2, seq: int = 8, vocab: int = 97, seed: int = 0
) -> list[torch.Tensor]:
    """``steps`` global batches of ``world * batch`` sequences (each rank takes its slice)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (world * batch, seq + 1), generator=gen) for _ in range(steps)]


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    if logits.dtype != torch.float64:  # low-precision logits: the loss in fp32
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
