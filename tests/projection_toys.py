"""Torch models built from shard-planner catalogue descriptions, and a measured training step.

Each parameter has the catalogue's name and shape (so ``fully_shard`` plans exactly the groups
the projection plans), and the forward uses the ops the projection's activation formula counts
(``shard_planner.projection`` ``activations`` Note): a fused RMSNorm that keeps its input and
inverse RMS, linear projections, ``scaled_dot_product_attention`` (flash kernel: it keeps q, k, v,
its output and log-sum-exp), SwiGLU, token-choice top-k experts, fp32 cross-entropy. Rotary
embeddings are left out (they keep nothing per token and cost no memory the formula counts).

Run as a script (a fresh process: the fake process group is global state)::

    python tests/projection_toys.py '[{"model": ..., "overrides": {...}, "world": 8, ...}]'

prints one JSON line per case: the measured peak of live storage on rank 0 during the
second training step (``dbuffer.testing.LiveBytes``), the phase where it occurred, and the engine's
shard sizes per group. Under the fake process group collectives move nothing, which changes no
allocation.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shard_planner.projection import GPUS, Group, Model, Setup, catalogue_model, project


class _RMSNorm(torch.autograd.Function):
    """RMSNorm that keeps only its input and the fp32 inverse RMS, like a fused kernel."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        x, rstd, weight = ctx.saved_tensors
        normed = x * rstd
        grad_w = (grad * normed).reshape(-1, x.shape[-1]).sum(0)
        g = grad * weight
        dot = (g * normed).mean(-1, keepdim=True)
        return ((g - normed * dot) * rstd).to(x.dtype), grad_w.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = _RMSNorm.apply(x, weight, 1e-6)
    return out


def _holder(weights: Any, dtype: torch.dtype) -> nn.Module:
    """A module tree whose parameters are the weights, by their dotted names, in their order."""
    root = nn.Module()
    for w in weights:
        *path, leaf = w.name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, nn.Module())
            mod = getattr(mod, part)
        std = 1.0 / math.sqrt(w.shape[-1]) if w.matrix else 0.0
        value = torch.randn(w.shape, dtype=dtype) * std if w.matrix else torch.ones(w.shape)
        mod.register_parameter(leaf, nn.Parameter(value.to(dtype)))
    return root


def _get(mod: nn.Module, name: str) -> torch.Tensor:
    for part in name.split("."):
        mod = getattr(mod, part)
    assert isinstance(mod, torch.Tensor)
    return mod


class Layer(nn.Module):
    """One decoder layer of a catalogue group (dense SwiGLU or routed experts)."""

    def __init__(self, group: Group, dtype: torch.dtype) -> None:
        super().__init__()
        shape = group.layer
        assert shape is not None
        self.shape = shape
        self.names = {w.name for w in group.weights}
        self.params = _holder(group.weights, dtype)

    def p(self, name: str) -> torch.Tensor:
        return _get(self.params, name)

    def has(self, name: str) -> bool:
        return name in self.names

    def _linear(self, x: torch.Tensor, name: str, bias: torch.Tensor | None = None) -> torch.Tensor:
        b = bias
        if b is None and self.has(name.replace(".weight", ".bias")):
            b = self.p(name.replace(".weight", ".bias"))
        return F.linear(x, self.p(name), b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        b, t, _ = x.shape
        y = rms_norm(x, self.p("input_layernorm.weight"))
        q = self._linear(y, "self_attn.q_proj.weight")
        k = self._linear(y, "self_attn.k_proj.weight")
        v = self._linear(y, "self_attn.v_proj.weight")
        hd = s.q_dim // s.heads
        q = q.view(b, t, s.heads, hd)
        k = k.view(b, t, s.kv_dim // hd, hd)
        if self.has("self_attn.q_norm.weight"):  # Qwen3: per-head RMSNorm of q and k
            q = rms_norm(q, self.p("self_attn.q_norm.weight"))
            k = rms_norm(k, self.p("self_attn.k_norm.weight"))
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.view(b, t, s.kv_dim // hd, hd).transpose(1, 2)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        bias = None
        if self.has("self_attn.sinks"):  # GPT-OSS: keep the sinks in the graph at no memory
            bias = self.p("self_attn.o_proj.bias") + 0.0 * self.p("self_attn.sinks").sum()
        x = x + self._linear(
            att.transpose(1, 2).reshape(b, t, s.v_dim), "self_attn.o_proj.weight", bias
        )
        y = rms_norm(x, self.p("post_attention_layernorm.weight"))
        if s.kind == "dense":
            gate = self._linear(y, "mlp.gate_proj.weight")
            up = self._linear(y, "mlp.up_proj.weight")
            out = self._linear(F.silu(gate) * up, "mlp.down_proj.weight")
        else:
            out = self._experts(y)
        result: torch.Tensor = x + out
        return result

    def _experts(self, y: torch.Tensor) -> torch.Tensor:
        s = self.shape
        flat = y.reshape(-1, y.shape[-1])
        router = "mlp.router.weight" if self.has("mlp.router.weight") else "mlp.gate.weight"
        probs = self._linear(flat, router).softmax(-1)
        top, chosen = probs.topk(s.top_k, dim=-1)
        gates = top / top.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        fused = self.has("mlp.experts.gate_up_proj")
        if fused:  # one view per expert; their gradients are stacked once, like a grouped GEMM
            gate_ups = self.p("mlp.experts.gate_up_proj").unbind(0)
            gate_up_biases = self.p("mlp.experts.gate_up_proj_bias").unbind(0)
            downs = self.p("mlp.experts.down_proj").unbind(0)
            down_biases = self.p("mlp.experts.down_proj_bias").unbind(0)
        for e in range(s.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            xe = flat[token]
            if fused:
                gu = xe @ gate_ups[e] + gate_up_biases[e]
                gate, up = gu.chunk(2, dim=-1)
                ye = (F.silu(gate) * up) @ downs[e] + down_biases[e]
            else:
                gate = self._linear(xe, f"mlp.experts.{e}.gate_proj.weight")
                up = self._linear(xe, f"mlp.experts.{e}.up_proj.weight")
                ye = self._linear(F.silu(gate) * up, f"mlp.experts.{e}.down_proj.weight")
            out = out.index_add(0, token, ye * gates[token, slot].unsqueeze(-1))
        result: torch.Tensor = out.reshape(y.shape)
        return result


class Embed(nn.Module):
    def __init__(self, group: Group, dtype: torch.dtype) -> None:
        super().__init__()
        self.params = _holder(group.weights, dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, _get(self.params, "embed_tokens.weight"))


class Head(nn.Module):
    def __init__(self, group: Group, dtype: torch.dtype) -> None:
        super().__init__()
        self.params = _holder(group.weights, dtype)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        y = rms_norm(x, _get(self.params, "norm.weight"))
        logits = F.linear(y, _get(self.params, "lm_head.weight"))
        loss: torch.Tensor = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1)
        )
        return loss


class Toy(nn.Module):
    """The catalogue model as a torch module: embed, the decoder layers in order, head."""

    def __init__(self, model: Model, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        groups = {g.layer.kind if g.layer else g.name: g for g in model.groups}
        self.embed = Embed(groups["embed"], dtype)
        self.layers = nn.ModuleList(
            Layer(g, dtype)
            for g in model.groups
            if g.layer is not None and g.layer.kind not in ("embed", "head")
            for _ in range(g.count)
        )
        self.head = Head(groups["head"], dtype)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        loss: torch.Tensor = self.head(x, targets)
        return loss


def measure(
    model: Model,
    world: int,
    *,
    seq: int,
    micro_batch: int,
    prefetch: int,
    layers_per_group: int,
    bf16: bool = False,
    engine: str = "ours",
) -> dict[str, Any]:
    """Rank 0's live-storage peak over the second step under the fake process group.

    ``engine="fsdp2"`` runs torch's ``fully_shard`` and per-parameter foreach AdamW instead of
    ours with ``optim_blockwise.FlatAdamW``."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dbuffer.testing import LiveBytes

    if engine == "ours":
        from fsdp_engine import MixedPrecisionPolicy, fully_shard
        from optim_blockwise import FlatAdamW
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]

    torch.manual_seed(0)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        toy = Toy(model)
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        groups: list[Any] = [fully_shard(toy.embed, mesh=mesh, mp_policy=mp)]
        layers = list(toy.layers)
        for start in range(0, len(layers), layers_per_group):
            chunk = layers[start : start + layers_per_group]
            unit = chunk if len(chunk) > 1 else chunk[0]
            groups.append(fully_shard(unit, mesh=mesh, mp_policy=mp))
        groups.append(fully_shard(toy.head, mesh=mesh, mp_policy=mp))
        fully_shard(toy, mesh=mesh, mp_policy=mp)
        if prefetch:
            units = [g[0] if isinstance(g, list) else g for g in groups]
            for i, unit in enumerate(units):
                unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + prefetch])
                unit.set_modules_to_backward_prefetch(units[max(0, i - prefetch) : i][::-1])
        opt: Any = (
            FlatAdamW(toy.parameters(), lr=1e-3)
            if engine == "ours"
            else torch.optim.AdamW(toy.parameters(), lr=1e-3, foreach=True)
        )
        gen = torch.Generator().manual_seed(0)
        vocab = _get(toy.embed.params, "embed_tokens.weight").shape[0]

        def step() -> None:
            tokens = torch.randint(0, vocab, (micro_batch, seq + 1), generator=gen)
            loss = toy(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()

        step()  # optimizer states are made here
        roots = [t for t in toy.state_dict().values() if isinstance(t, torch.Tensor)]
        seed = [getattr(t, "_local_tensor", t) for t in roots]
        states = [v for st in opt.state.values() for v in st.values()]
        seed += [getattr(v, "_local_tensor", v) for v in states if isinstance(v, torch.Tensor)]
        with LiveBytes(seed=seed) as live:
            start = live.current
            step()
        shards = []
        for g in groups if engine == "ours" else ():
            unit = g[0] if isinstance(g, list) else g
            p = unit.shard_plan()
            shards.append(None if p is None else p.shard_size)
        return {"world": world, "peak": live.peak, "start": start, "shards": shards}
    finally:
        dist.destroy_process_group()


# -- the validation cases (``tests/test_projection_validation.py``, the benchmark) ------------

SCALED = {
    "llama3-8b": {
        "hidden": 128,
        "layers": 3,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "ffn": 384,
        "vocab": 512,
    },
    "qwen3-30b-a3b": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "vocab": 512,
        "experts": 8,
        "experts_per_token": 2,
        "expert_ffn": 96,
    },
    "gpt-oss-120b": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "vocab": 512,
        "experts": 8,
        "experts_per_token": 2,
        "expert_ffn": 96,
    },
}


def _case(model: str, world: int, engine: str = "ours", **extra: Any) -> dict[str, Any]:
    case = {
        "model": model,
        "overrides": SCALED[model],
        "world": world,
        "seq": 32,
        "micro_batch": 2,
        "prefetch": 0,
        "layers_per_group": 1,
        "engine": engine,
        "bf16": False,
    }
    case.update(extra)
    return case


CASES = [
    *(_case(m, w, e) for e in ("ours", "fsdp2") for m in SCALED for w in (8, 64, 256)),
    # our forward prefetch, several layers per group, long sequences, bf16 + fp32 reduction
    _case("llama3-8b", 64, prefetch=1),
    _case("llama3-8b", 64, layers_per_group=2),
    _case("llama3-8b", 8, seq=256),
    _case("gpt-oss-120b", 256, bf16=True, prefetch=1),
    _case("qwen3-30b-a3b", 64, bf16=True),
    _case("gpt-oss-120b", 256, "fsdp2", bf16=True),
    _case("llama3-8b", 64, "fsdp2", bf16=True),
]


def projected(case: dict[str, Any]) -> tuple[int, list[int]]:
    """The projection's peak and per-group shard sizes for one case (same settings)."""
    model = catalogue_model(case["model"], case["overrides"])
    setup = Setup(
        seq=case["seq"],
        micro_batch=case["micro_batch"],
        param_bytes=4,
        compute_bytes=2 if case["bf16"] else 4,
        reduce_bytes=4,
        forward_prefetch=case["prefetch"],
        backward_prefetch=1,  # both engines' default
    )
    p = project(
        model, case["world"], GPUS["H100"], setup, layers_per_group=case["layers_per_group"]
    )
    engine = p.ours if case["engine"] == "ours" else p.fsdp2
    shards = [g.shard for g in engine.groups for _ in range(g.count)]
    return engine.peak_bytes, shards


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "cases",
        help='JSON list of {"model", "overrides", "world", "seq", "micro_batch", '
        '"prefetch", "layers_per_group"}',
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    for case in json.loads(args.cases):
        model = catalogue_model(case["model"], case["overrides"])
        result = measure(
            model,
            case["world"],
            seq=case["seq"],
            micro_batch=case["micro_batch"],
            prefetch=case["prefetch"],
            layers_per_group=case["layers_per_group"],
            bf16=case.get("bf16", False),
            engine=case.get("engine", "ours"),
        )
        print(json.dumps({**case, **result}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
