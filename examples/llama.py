"""A small LLaMA-like decoder and its data, shared by the demo and the benchmark (one copy).

- Data: character-level text from ``pydoc_data.topics``, which ships with every CPython (about
  465k characters, ~100 distinct): nothing is downloaded. 90% train, 10% validation.
- Model: token embedding, ``layers`` blocks of (RMSNorm, causal multi-head attention with rotary
  positions through ``scaled_dot_product_attention``, RMSNorm, SwiGLU MLP), final RMSNorm and an
  untied output head. With ``experts > 0`` the MLP is a mixture of experts (a linear router, top-k
  softmax gates, ``experts`` small SwiGLU experts): many small matrices, the case where
  per-parameter sharding pays most in copies and padding.

Every parameter is plain fp32 and initialised from ``torch.manual_seed`` so that all ranks (and all
engines in the benchmark) build the same model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "Corpus",
    "ModelConfig",
    "Llama",
    "Block",
    "load_corpus",
    "get_batch",
    "loss_fn",
    "muon_param_groups",
]


# -- data ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # int64 token ids
    val: torch.Tensor
    chars: str  # the vocabulary: token i is chars[i]

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def decode(self, tokens: torch.Tensor) -> str:
        return "".join(self.chars[int(t)] for t in tokens)


def load_corpus() -> Corpus:
    """The pydoc topics text as character ids (deterministic: topics in sorted order)."""
    import pydoc_data.topics

    topics: dict[str, str] = pydoc_data.topics.topics
    text = "".join(topics[k] for k in sorted(topics))
    chars = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return Corpus(data[:split], data[split:], chars)


def get_batch(data: torch.Tensor, gen: torch.Generator, size: int, seq: int) -> torch.Tensor:
    """``size`` random windows of ``seq + 1`` tokens (inputs ``[:, :-1]``, targets ``[:, 1:]``)."""
    starts = torch.randint(0, len(data) - seq - 1, (size,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()])


# -- model -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 103
    dim: int = 128
    layers: int = 4
    heads: int = 4
    ffn: int = 384
    experts: int = 0  # 0: dense SwiGLU MLP; > 0: mixture of experts of width ``ffn`` each
    top_k: int = 2
    seq: int = 128

    def with_vocab(self, vocab: int) -> ModelConfig:
        return replace(self, vocab=vocab)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


PRESETS: dict[str, ModelConfig] = {
    # demo default on 2 CPU cores: ~0.8M parameters
    "tiny": ModelConfig(dim=64, layers=2, heads=4, ffn=192, seq=64),
    "small": ModelConfig(dim=128, layers=4, heads=4, ffn=384, seq=128),
    "medium": ModelConfig(dim=256, layers=4, heads=8, ffn=768, seq=256),
    # MoE-like: 16 experts per layer; dims (90, 45) and expert rows do not divide 2, 4 or 8
    "moe": ModelConfig(dim=90, layers=2, heads=6, ffn=45, experts=16, top_k=2, seq=128),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of ``(batch, heads, seq, head_dim)``."""
    seq, dim = x.shape[-2], x.shape[-1]
    half = dim // 2
    inv = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * inv[None]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)  # odd head_dim: last dim unrotated


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, ffn, bias=False)
        self.up = nn.Linear(dim, ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.silu(self.gate(x)) * self.up(x))
        return out


class MoE(nn.Module):
    """Top-k mixture of SwiGLU experts. Every expert runs every step (on the tokens routed to it,
    possibly none), so every parameter gets a gradient and all ranks run the same collectives."""

    def __init__(self, dim: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, ffn) for _ in range(experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        gates, chosen = self.router(flat).softmax(-1).topk(self.top_k, dim=-1)
        gates = gates / gates.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            y = expert(flat[token]) * gates[token, slot].unsqueeze(-1)
            out = out.index_add(0, token, y)
        result: torch.Tensor = out.reshape(shape)
        return result


class Block(nn.Module):
    """One decoder layer; the unit of sharding (one ``fully_shard`` call each)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.attn_norm = RMSNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp: nn.Module = (
            MoE(cfg.dim, cfg.ffn, cfg.experts, cfg.top_k)
            if cfg.experts
            else SwiGLU(cfg.dim, cfg.ffn)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim {cfg.dim} must be a multiple of heads {cfg.heads}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 1 / math.sqrt(p.shape[-1])
                if name.endswith(("proj.weight", "down.weight")):
                    std /= math.sqrt(2 * cfg.layers)  # residual branches, GPT-2 style
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        logits: torch.Tensor = self.head(self.norm(x))
        return logits


def loss_fn(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def muon_param_groups(
    model: nn.Module,
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(hidden 2-D matrices for Muon, the rest for AdamW: embedding, head, norms)."""
    hidden: list[nn.Parameter] = []
    other: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        (hidden if p.dim() == 2 and name.startswith("layers.") else other).append(p)
    return hidden, other
