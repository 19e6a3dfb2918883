"""Parameter shapes of public models, grouped per layer as FSDP wraps them.

The hyper-parameters are copied from the models' published configs (see ``CONFIGS``); every
weight's shape is derived here by us from them, following each model's public modelling code
conventions (``nn.Linear`` weights are ``[out_features, in_features]``).

[Note: groups]
FSDP wraps each decoder layer as one group, plus the input embedding and the final norm with the
output head. Layers of one model share a structure, so each distinct group is listed once with a
``count``. Multi-token-prediction modules (DeepSeek-V3's MTP) are not part of the base model and
are left out.

[Note: blocks from row granularity]
A weight is ``(R, C)`` with ``R = prod(shape[:-1])`` rows of ``C = shape[-1]`` elements (a fused
3-D expert tensor ``[E, h, n]`` is ``E*h`` rows of ``n``). With a granularity of ``r`` rows its
block is ``gcd(r, R)`` rows, i.e. ``gcd(r, R) * C`` elements (equal to ``r`` rows for every
matrix of the catalogue but a few small ones, e.g. DeepSeek's 576-row ``kv_a_proj``). Vectors
(1-D norms and biases, per-expert bias tables, attention sinks, the router's score bias) carry no
block structure an optimizer relies on and get block 1. Tiles: a ``32 x 32`` (or ``128 x 128``)
tile is not contiguous in a row-major matrix; keeping every tile whole on one rank means shard
boundaries on 32-row (128-row) multiples, so a tile granularity ``t x t`` is the row granularity
``t`` here, as the veScale paper does for 8-bit Adam.
"""

from __future__ import annotations

import math

import attrs

from shard_planner._private.spec import TensorSpec

__all__ = ["CONFIGS", "MODELS", "Group", "Model", "Weight", "catalogue_model"]


@attrs.frozen
class Weight:
    """One parameter: its name, shape, and whether it is a matrix (gets row blocks)."""

    name: str
    shape: tuple[int, ...]
    matrix: bool = True

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def block(self, rows: int) -> int:
        """Block in elements for a granularity of ``rows`` rows (module Note)."""
        if not self.matrix or len(self.shape) < 2 or rows <= 1:
            return self.shape[-1] if self.matrix and len(self.shape) >= 2 else 1
        r = math.prod(self.shape[:-1])
        return math.gcd(rows, r) * self.shape[-1]


@attrs.frozen
class Group:
    """Tensors FSDP gathers together, and how many identical such groups the model has."""

    name: str
    weights: tuple[Weight, ...]
    count: int = 1

    @property
    def numel(self) -> int:
        return sum(w.numel for w in self.weights)

    def specs(self, rows: int) -> list[TensorSpec]:
        return [TensorSpec(w.numel, w.block(rows), w.name) for w in self.weights]


@attrs.frozen
class Model:
    name: str
    groups: tuple[Group, ...]

    @property
    def numel(self) -> int:
        return sum(g.numel * g.count for g in self.groups)

    @property
    def largest_group(self) -> Group:
        return max(self.groups, key=lambda g: (g.numel, len(g.weights)))


# Published hyper-parameters (copied; the shapes below are our derivation).
CONFIGS: dict[str, dict[str, int | bool]] = {
    "llama3-8b": {
        "hidden": 4096,
        "layers": 32,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "ffn": 14336,
        "vocab": 128256,
    },
    "llama3-70b": {
        "hidden": 8192,
        "layers": 80,
        "heads": 64,
        "kv_heads": 8,
        "head_dim": 128,
        "ffn": 28672,
        "vocab": 128256,
    },
    "gpt-oss-120b": {
        "hidden": 2880,
        "layers": 36,
        "heads": 64,
        "kv_heads": 8,
        "head_dim": 64,
        "vocab": 201088,
        "experts": 128,
        "expert_ffn": 2880,
    },
    "deepseek-v3-671b": {
        "hidden": 7168,
        "layers": 61,
        "first_dense_layers": 3,
        "dense_ffn": 18432,
        "vocab": 129280,
        "heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "routed_experts": 256,
        "shared_experts": 1,
        "expert_ffn": 2048,
    },
    "qwen3-30b-a3b": {
        "hidden": 2048,
        "layers": 48,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
        "vocab": 151936,
        "experts": 128,
        "expert_ffn": 768,
    },
}


def _vec(name: str, *shape: int) -> Weight:
    return Weight(name, tuple(shape), matrix=False)


def _mat(name: str, *shape: int) -> Weight:
    return Weight(name, tuple(shape))


def _ends(h: int, vocab: int, layers: int, body: list[Group]) -> tuple[Group, ...]:
    embed = Group("embed", (_mat("embed_tokens.weight", vocab, h),))
    head = Group("head", (_vec("norm.weight", h), _mat("lm_head.weight", vocab, h)))
    assert sum(g.count for g in body) == layers
    return (embed, *body, head)


def _llama(name: str) -> Model:
    c = CONFIGS[name]
    h, hd, ffn = int(c["hidden"]), int(c["head_dim"]), int(c["ffn"])
    q, kv = int(c["heads"]) * hd, int(c["kv_heads"]) * hd
    layer = Group(
        "layer",
        (
            _vec("input_layernorm.weight", h),
            _mat("self_attn.q_proj.weight", q, h),
            _mat("self_attn.k_proj.weight", kv, h),
            _mat("self_attn.v_proj.weight", kv, h),
            _mat("self_attn.o_proj.weight", h, q),
            _vec("post_attention_layernorm.weight", h),
            _mat("mlp.gate_proj.weight", ffn, h),
            _mat("mlp.up_proj.weight", ffn, h),
            _mat("mlp.down_proj.weight", h, ffn),
        ),
        count=int(c["layers"]),
    )
    return Model(name, _ends(h, int(c["vocab"]), int(c["layers"]), [layer]))


def _gpt_oss() -> Model:
    c = CONFIGS["gpt-oss-120b"]
    h, hd = int(c["hidden"]), int(c["head_dim"])
    n_exp, ffn = int(c["experts"]), int(c["expert_ffn"])
    q, kv = int(c["heads"]) * hd, int(c["kv_heads"]) * hd
    layer = Group(
        "layer",
        (
            _vec("input_layernorm.weight", h),
            _mat("self_attn.q_proj.weight", q, h),
            _vec("self_attn.q_proj.bias", q),
            _mat("self_attn.k_proj.weight", kv, h),
            _vec("self_attn.k_proj.bias", kv),
            _mat("self_attn.v_proj.weight", kv, h),
            _vec("self_attn.v_proj.bias", kv),
            _mat("self_attn.o_proj.weight", h, q),
            _vec("self_attn.o_proj.bias", h),
            _vec("self_attn.sinks", int(c["heads"])),
            _vec("post_attention_layernorm.weight", h),
            _mat("mlp.router.weight", n_exp, h),
            _vec("mlp.router.bias", n_exp),
            # Fused experts: [E, hidden, 2*ffn] (gate and up interleaved) and [E, ffn, hidden].
            _mat("mlp.experts.gate_up_proj", n_exp, h, 2 * ffn),
            _vec("mlp.experts.gate_up_proj_bias", n_exp, 2 * ffn),
            _mat("mlp.experts.down_proj", n_exp, ffn, h),
            _vec("mlp.experts.down_proj_bias", n_exp, h),
        ),
        count=int(c["layers"]),
    )
    return Model("gpt-oss-120b", _ends(h, int(c["vocab"]), int(c["layers"]), [layer]))


def _deepseek() -> Model:
    c = CONFIGS["deepseek-v3-671b"]
    h, heads = int(c["hidden"]), int(c["heads"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    q_rank, kv_rank = int(c["q_lora_rank"]), int(c["kv_lora_rank"])
    attn = (
        _vec("input_layernorm.weight", h),
        _mat("self_attn.q_a_proj.weight", q_rank, h),
        _vec("self_attn.q_a_layernorm.weight", q_rank),
        _mat("self_attn.q_b_proj.weight", heads * (nope + rope), q_rank),
        _mat("self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, h),
        _vec("self_attn.kv_a_layernorm.weight", kv_rank),
        _mat("self_attn.kv_b_proj.weight", heads * (nope + v), kv_rank),
        _mat("self_attn.o_proj.weight", h, heads * v),
        _vec("post_attention_layernorm.weight", h),
    )
    dense_ffn, ffn = int(c["dense_ffn"]), int(c["expert_ffn"])
    dense = Group(
        "dense_layer",
        (
            *attn,
            _mat("mlp.gate_proj.weight", dense_ffn, h),
            _mat("mlp.up_proj.weight", dense_ffn, h),
            _mat("mlp.down_proj.weight", h, dense_ffn),
        ),
        count=int(c["first_dense_layers"]),
    )
    experts: list[Weight] = []
    for j in range(int(c["routed_experts"])):
        experts += [
            _mat(f"mlp.experts.{j}.gate_proj.weight", ffn, h),
            _mat(f"mlp.experts.{j}.up_proj.weight", ffn, h),
            _mat(f"mlp.experts.{j}.down_proj.weight", h, ffn),
        ]
    shared = int(c["shared_experts"]) * ffn
    moe = Group(
        "moe_layer",
        (
            *attn,
            _mat("mlp.gate.weight", int(c["routed_experts"]), h),
            _vec("mlp.gate.e_score_correction_bias", int(c["routed_experts"])),
            *experts,
            _mat("mlp.shared_experts.gate_proj.weight", shared, h),
            _mat("mlp.shared_experts.up_proj.weight", shared, h),
            _mat("mlp.shared_experts.down_proj.weight", h, shared),
        ),
        count=int(c["layers"]) - int(c["first_dense_layers"]),
    )
    return Model("deepseek-v3-671b", _ends(h, int(c["vocab"]), int(c["layers"]), [dense, moe]))


def _qwen_moe() -> Model:
    c = CONFIGS["qwen3-30b-a3b"]
    h, hd = int(c["hidden"]), int(c["head_dim"])
    ffn, n_exp = int(c["expert_ffn"]), int(c["experts"])
    q, kv = int(c["heads"]) * hd, int(c["kv_heads"]) * hd
    experts: list[Weight] = []
    for j in range(n_exp):
        experts += [
            _mat(f"mlp.experts.{j}.gate_proj.weight", ffn, h),
            _mat(f"mlp.experts.{j}.up_proj.weight", ffn, h),
            _mat(f"mlp.experts.{j}.down_proj.weight", h, ffn),
        ]
    layer = Group(
        "layer",
        (
            _vec("input_layernorm.weight", h),
            _mat("self_attn.q_proj.weight", q, h),
            _mat("self_attn.k_proj.weight", kv, h),
            _mat("self_attn.v_proj.weight", kv, h),
            _mat("self_attn.o_proj.weight", h, q),
            _vec("self_attn.q_norm.weight", hd),
            _vec("self_attn.k_norm.weight", hd),
            _vec("post_attention_layernorm.weight", h),
            _mat("mlp.gate.weight", n_exp, h),
            *experts,
        ),
        count=int(c["layers"]),
    )
    return Model("qwen3-30b-a3b", _ends(h, int(c["vocab"]), int(c["layers"]), [layer]))


MODELS = ("llama3-8b", "llama3-70b", "gpt-oss-120b", "deepseek-v3-671b", "qwen3-30b-a3b")


def catalogue_model(name: str) -> Model:
    """The model ``name`` (one of ``MODELS``) with its groups and derived shapes."""
    if name in ("llama3-8b", "llama3-70b"):
        return _llama(name)
    if name == "gpt-oss-120b":
        return _gpt_oss()
    if name == "deepseek-v3-671b":
        return _deepseek()
    if name == "qwen3-30b-a3b":
        return _qwen_moe()
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")
