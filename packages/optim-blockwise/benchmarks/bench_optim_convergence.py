"""Convergence benchmark: AdamW vs Muon vs Shampoo vs SOAP vs 8-bit AdamW, ours beside the peers.

A small LLaMA-like decoder (RMSNorm, rotary attention, SwiGLU, untied head), character level, on
``pydoc_data.topics`` (ships with CPython: nothing is downloaded). Every optimizer trains the
same initial model on the same batches; validation loss on fixed held-out batches.

Optimizers: ``torch.optim.AdamW``; ours ``optim_blockwise.AdamW8bit`` and ``optim_blockwise.Muon``
(hidden matrices Muon, embeddings/head/norms AdamW), ``optim_blockwise.Shampoo`` (Adam grafting)
and ``optim_blockwise.SOAP`` (every parameter; vectors take their elementwise path); peers
``torch.optim.Muon`` (+ AdamW for the rest), torchao ``AdamW8bit`` and bitsandbytes ``AdamW8bit``
when installed (skipped otherwise, and said so in the table).

Writes ``convergence.png``, ``convergence.md`` (table: final val loss mean over seeds, step
time median, optimizer state bytes per parameter) and ``convergence.json`` (the same figures)
into the results folder (default ``results/``). About two minutes on one CPU thread with the
defaults.

    python bench_optim_convergence.py [results] [--steps 600] [--seeds 1] [--lr 1e-2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao eager on CPU (compile takes ~46 s)

import torch
import torch.nn.functional as F
from torch import nn

import optim_blockwise as ob

# -- data ------------------------------------------------------------------------------------


def load_corpus() -> tuple[torch.Tensor, torch.Tensor, int]:
    import pydoc_data.topics

    text = "".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    data = torch.tensor([index[c] for c in text], dtype=torch.long)
    split = int(0.9 * len(data))
    return data[:split], data[split:], len(chars)


def batch(data: torch.Tensor, gen: torch.Generator, size: int, context: int) -> torch.Tensor:
    starts = torch.randint(0, len(data) - context - 1, (size,), generator=gen)
    return torch.stack([data[s : s + context + 1] for s in starts.tolist()])


# -- model -----------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def rotary(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding over the last dim of (batch, heads, seq, head_dim)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = torch.arange(seq, dtype=torch.float32, device=x.device)[:, None] * inv[None]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = RMSNorm(dim)
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, self.heads, -1).unbind(2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, 4 * dim) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def hidden_matrices(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(Muon params: 2-D weights inside blocks, AdamW params: embeddings, head, norms)."""
    hidden, other = [], []
    for name, p in model.named_parameters():
        (hidden if p.dim() == 2 and name.startswith("blocks.") else other).append(p)
    return hidden, other


# -- optimizers ------------------------------------------------------------------------------


class Pair:
    """Two optimizers stepped together (torch's Muon only takes 2-D params)."""

    def __init__(self, *opts: torch.optim.Optimizer) -> None:
        self.opts = opts

    def step(self) -> None:
        for o in self.opts:
            o.step()

    def zero_grad(self) -> None:
        for o in self.opts:
            o.zero_grad(set_to_none=True)

    def state_tensors(self) -> list[torch.Tensor]:
        return [t for o in self.opts for t in _state_tensors(o)]


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for state in opt.state.values():
        for key, value in state.items():
            if key == "step" or not isinstance(value, torch.Tensor):
                continue
            # torchao keeps its 8-bit state in tensor subclasses with codes and scales inside.
            inner = [getattr(value, a) for a in ("codes", "scale") if hasattr(value, a)]
            out.extend(inner if inner else [value])
    return out


WD = 0.1
BETAS = (0.9, 0.95)
# Sweep (1 seed, 600 steps, val loss): Shampoo lr {3e-3, 1e-2, 2e-2, 4e-2} gave
# {1.516, 1.396, 1.395, 1.424}; SOAP the same lrs {1.543, 1.389, 1.385, 1.412}.
SHAMPOO_LR = 2e-2
SOAP_LR = 2e-2


def make_optimizers(
    lr: float, muon_lr: float, shampoo_lr: float = 1e-2, soap_lr: float = 1e-2
) -> dict[str, Callable[[nn.Module], Any]]:
    """Factories; ``muon_lr`` is the Muon matrices' lr, the rest of a Muon run uses ``lr``;
    Shampoo and SOAP use their own tuned lr on every parameter."""

    def adamw(m: nn.Module) -> Any:
        return Pair(torch.optim.AdamW(m.parameters(), lr=lr, betas=BETAS, weight_decay=WD))

    def ours_8bit(m: nn.Module) -> Any:
        return Pair(ob.AdamW8bit(m.parameters(), lr=lr, betas=BETAS, weight_decay=WD))

    def ours_muon(m: nn.Module) -> Any:
        hidden, other = hidden_matrices(m)
        return Pair(
            ob.Muon(
                [{"params": hidden}, {"params": other, "use_muon": False, "lr": lr}],
                lr=muon_lr,
                weight_decay=WD,
                adjust_lr_fn="match_rms_adamw",
                adamw_betas=BETAS,
            )
        )

    def ours_shampoo(m: nn.Module) -> Any:
        return Pair(
            ob.Shampoo(
                m.parameters(),
                lr=shampoo_lr,
                betas=BETAS,
                weight_decay=WD,
                precondition_frequency=10,
                grafting="adam",
                grafting_beta2=BETAS[1],
            )
        )

    def ours_soap(m: nn.Module) -> Any:
        return Pair(
            ob.SOAP(
                m.parameters(), lr=soap_lr, betas=BETAS, weight_decay=WD, precondition_frequency=10
            )
        )

    def torch_muon(m: nn.Module) -> Any:
        hidden, other = hidden_matrices(m)
        return Pair(
            torch.optim.Muon(hidden, lr=muon_lr, weight_decay=WD, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(other, lr=lr, betas=BETAS, weight_decay=WD),
        )

    def torchao_8bit(m: nn.Module) -> Any:
        from torchao.optim import AdamW8bit

        return Pair(AdamW8bit(m.parameters(), lr=lr, betas=BETAS, weight_decay=WD))

    def bnb_8bit(m: nn.Module) -> Any:
        import bitsandbytes as bnb

        return Pair(bnb.optim.AdamW8bit(m.parameters(), lr=lr, betas=BETAS, weight_decay=WD))

    return {
        "torch AdamW": adamw,
        "ours AdamW8bit": ours_8bit,
        "torchao AdamW8bit": torchao_8bit,
        "bitsandbytes AdamW8bit": bnb_8bit,
        "ours Muon": ours_muon,
        "torch.optim.Muon": torch_muon,
        "ours Shampoo": ours_shampoo,
        "ours SOAP": ours_soap,
    }


# -- training --------------------------------------------------------------------------------


def train(
    name: str,
    factory: Callable[[nn.Module], Any],
    data: tuple[torch.Tensor, torch.Tensor, int],
    seed: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    train_data, val_data, vocab = data
    torch.manual_seed(seed)
    model = TinyLlama(vocab, dim=args.dim, layers=args.layers)
    opt = factory(model)
    gen = torch.Generator().manual_seed(1000 + seed)
    val_gen = torch.Generator().manual_seed(99)
    val_batches = [batch(val_data, val_gen, args.batch, args.context) for _ in range(8)]
    curve: list[tuple[int, float]] = []
    times = []
    warmup = max(1, args.steps // 20)

    def evaluate() -> float:
        model.eval()
        with torch.no_grad():
            losses = [
                F.cross_entropy(model(b[:, :-1]).reshape(-1, vocab), b[:, 1:].reshape(-1))
                for b in val_batches
            ]
        model.train()
        return float(torch.stack(losses).mean())

    base_lrs = [[g["lr"] for g in o.param_groups] for o in opt.opts]
    for step in range(args.steps):
        # Linear warmup then cosine decay to 10%: the same schedule for every optimizer.
        if step < warmup:
            scale = (step + 1) / warmup
        else:
            progress = (step - warmup) / max(1, args.steps - warmup)
            scale = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
        for o, lrs in zip(opt.opts, base_lrs, strict=True):
            for g, lr in zip(o.param_groups, lrs, strict=True):
                g["lr"] = lr * scale
        tokens = batch(train_data, gen, args.batch, args.context)
        start = time.perf_counter()
        loss = F.cross_entropy(model(tokens[:, :-1]).reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        if (step + 1) % args.eval_every == 0 or step == 0:
            curve.append((step + 1, evaluate()))
    n_params = sum(p.numel() for p in model.parameters())
    state_bytes = sum(t.numel() * t.element_size() for t in opt.state_tensors())
    return {
        "name": name,
        "seed": seed,
        "curve": curve,
        "final": curve[-1][1],
        "step_ms": 1000 * statistics.median(times),
        "state_bytes_per_param": state_bytes / n_params,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="results")
    parser.add_argument("--out", dest="out_opt", default=None)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--seeds", type=int, default=1)
    # Defaults from a coarse sweep (1 seed, 600 steps): AdamW lr {3e-3, 1e-2, 2e-2} gave val
    # {1.548, 1.463, 1.465}; Muon matrices {1e-2, 2e-2, 3e-2} (match_rms_adamw) were best at 2e-2.
    parser.add_argument("--lr", type=float, default=1e-2, help="AdamW-family lr")
    parser.add_argument("--muon-lr", type=float, default=2e-2, help="lr of Muon's matrices")
    parser.add_argument("--shampoo-lr", type=float, default=SHAMPOO_LR, help="Shampoo's lr")
    parser.add_argument("--soap-lr", type=float, default=SOAP_LR, help="SOAP's lr")
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--only", default="", help="comma-separated optimizer names (substring)")
    args = parser.parse_args(argv)
    out = Path(args.out_opt or args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    data = load_corpus()
    results: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    wall = time.perf_counter()
    factories = make_optimizers(args.lr, args.muon_lr, args.shampoo_lr, args.soap_lr)
    for name, factory in factories.items():
        if args.only and not any(s.strip() in name for s in args.only.split(",")):
            continue
        for seed in range(args.seeds):
            try:
                r = train(name, factory, data, seed, args)
            except ImportError as exc:
                skipped[name] = f"not installed ({exc.name})"
                break
            results.append(r)
            print(
                f"{name:24s} seed {seed}: val {r['final']:.4f}  step {r['step_ms']:.1f} ms  "
                f"state {r['state_bytes_per_param']:.2f} B/param",
                flush=True,
            )
    names = list(dict.fromkeys(r["name"] for r in results))
    lines = [
        f"Tiny LLaMA-like char model (dim {args.dim}, {args.layers} layers, context "
        f"{args.context}, batch {args.batch}) on pydoc_data.topics, {args.steps} steps, lr "
        f"{args.lr} (Muon matrices: lr {args.muon_lr}, match_rms_adamw scaling; Shampoo lr "
        f"{args.shampoo_lr}, SOAP lr {args.soap_lr}), wd {WD}, "
        f"betas {BETAS}, "
        f"{args.seeds} seed(s), 1 CPU thread, torch {torch.__version__}.",
        "",
        "| optimizer | final val loss (mean) | min / max over seeds | step time median (ms) "
        "| optimizer state (bytes/param) |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        rs = [r for r in results if r["name"] == name]
        finals = [r["final"] for r in rs]
        lines.append(
            f"| {name} | {statistics.mean(finals):.4f} | {min(finals):.4f} / {max(finals):.4f} "
            f"| {statistics.median(r['step_ms'] for r in rs):.1f} "
            f"| {rs[0]['state_bytes_per_param']:.2f} |"
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | skipped: {why} | | | |")
    lines.append("")
    lines.append(f"Wall time {time.perf_counter() - wall:.0f} s.")
    (out / "convergence.md").write_text("\n".join(lines) + "\n")
    summary = {
        "args": vars(args),
        "torch": torch.__version__,
        "load": " ".join(Path("/proc/loadavg").read_text().split()[:3])
        if Path("/proc/loadavg").exists()
        else "?",
        "rows": [
            {
                "name": name,
                "final_mean": statistics.mean(r["final"] for r in results if r["name"] == name),
                "finals": [r["final"] for r in results if r["name"] == name],
                "step_ms": statistics.median(r["step_ms"] for r in results if r["name"] == name),
                "state_bytes_per_param": next(
                    r["state_bytes_per_param"] for r in results if r["name"] == name
                ),
            }
            for name in names
        ],
        "skipped": skipped,
    }
    (out / "convergence.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no PNG", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for name in names:
        rs = [r for r in results if r["name"] == name]
        steps = [s for s, _ in rs[0]["curve"]]
        mean = [statistics.mean(r["curve"][i][1] for r in rs) for i in range(len(steps))]
        style = "-" if name.startswith("ours") else "--"
        ax.plot(steps, mean, style, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_ylim(top=min(4.0, ax.get_ylim()[1]))
    ax.set_title("pydoc_data.topics, tiny LLaMA-like char model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "convergence.png", dpi=120)
    print(f"wrote {out / 'convergence.png'} and {out / 'convergence.md'}")


if __name__ == "__main__":
    main()
