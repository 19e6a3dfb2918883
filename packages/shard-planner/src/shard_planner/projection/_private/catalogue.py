"""Parameter shapes of public models, grouped per layer as FSDP wraps them.

The hyper-parameters are copied from the models' published configs (see ``CONFIGS``); every
weight's shape is derived here by us from them, following each model's public modelling code
conventions (``nn.Linear`` weights are ``[out_features, in_features]``).

[Note: groups]
FSDP wraps each decoder layer as one group, plus the input embedding and the final norm with the
output head. Layers of one model share a structure, so each distinct group is listed once with a
``count``. Multi-token-prediction modules (DeepSeek-V3's MTP) are not part of the base model and
are left out.

The value types (and how a weight's block follows from its rows) are in ``shapes``.
"""

from __future__ import annotations

from collections.abc import Mapping

from shard_planner.projection._private.shapes import Group, LayerShape, Model, Weight

__all__ = ["CONFIGS", "MODELS", "Group", "LayerShape", "Model", "Weight", "catalogue_model"]


# Published hyper-parameters (copied from the models' configs; the same values as the project's
# shared ``model-configs.json``, which a test compares; the shapes below are our derivation).
CONFIGS: dict[str, dict[str, int | bool]] = {
    "llama3-8b": {
        "hidden": 4096,
        "layers": 32,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "ffn": 14336,
        "vocab": 128256,
        "tied_embeddings": False,
    },
    "llama3-70b": {
        "hidden": 8192,
        "layers": 80,
        "heads": 64,
        "kv_heads": 8,
        "head_dim": 128,
        "ffn": 28672,
        "vocab": 128256,
        "tied_embeddings": False,
    },
    "gpt-oss-120b": {
        "hidden": 2880,
        "layers": 36,
        "heads": 64,
        "kv_heads": 8,
        "head_dim": 64,
        "vocab": 201088,
        "attention_bias": True,
        "attention_sinks": True,
        "experts": 128,
        "experts_per_token": 4,
        "expert_ffn": 2880,
        "experts_fused": True,
    },
    "deepseek-v3-671b": {
        "hidden": 7168,
        "layers": 61,
        "first_dense_layers": 3,
        "dense_ffn": 18432,
        "vocab": 129280,
        "tied_embeddings": False,
        "heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "routed_experts": 256,
        "shared_experts": 1,
        "experts_per_token": 8,
        "expert_ffn": 2048,
        "experts_fused": False,
    },
    "qwen3-30b-a3b": {
        "hidden": 2048,
        "layers": 48,
        "heads": 32,
        "kv_heads": 4,
        "head_dim": 128,
        "vocab": 151936,
        "qk_norm": True,
        "experts": 128,
        "experts_per_token": 8,
        "expert_ffn": 768,
        "experts_fused": False,
        "tied_embeddings": False,
    },
}

Config = Mapping[str, int | bool]


def _vec(name: str, *shape: int) -> Weight:
    return Weight(name, tuple(shape), matrix=False)


def _mat(name: str, *shape: int, active: float = 1.0) -> Weight:
    return Weight(name, tuple(shape), active=active)


def _ends(c: Config, body: list[Group]) -> tuple[Group, ...]:
    h, vocab = int(c["hidden"]), int(c["vocab"])
    embed = Group(
        "embed",
        (_mat("embed_tokens.weight", vocab, h),),
        layer=LayerShape("embed", h, vocab=vocab),
    )
    head = Group(
        "head",
        (_vec("norm.weight", h), _mat("lm_head.weight", vocab, h)),
        layer=LayerShape("head", h, vocab=vocab),
    )
    assert sum(g.count for g in body) == int(c["layers"])
    return (embed, *body, head)


def _llama(c: Config) -> tuple[Group, ...]:
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
        layer=LayerShape("dense", h, heads=int(c["heads"]), q_dim=q, kv_dim=kv, v_dim=q, ffn=ffn),
    )
    return _ends(c, [layer])


def _gpt_oss(c: Config) -> tuple[Group, ...]:
    h, hd = int(c["hidden"]), int(c["head_dim"])
    n_exp, ffn, k = int(c["experts"]), int(c["expert_ffn"]), int(c["experts_per_token"])
    q, kv = int(c["heads"]) * hd, int(c["kv_heads"]) * hd
    routed = k / n_exp
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
            _mat("mlp.experts.gate_up_proj", n_exp, h, 2 * ffn, active=routed),
            _vec("mlp.experts.gate_up_proj_bias", n_exp, 2 * ffn),
            _mat("mlp.experts.down_proj", n_exp, ffn, h, active=routed),
            _vec("mlp.experts.down_proj_bias", n_exp, h),
        ),
        count=int(c["layers"]),
        layer=LayerShape(
            "moe",
            h,
            heads=int(c["heads"]),
            q_dim=q,
            kv_dim=kv,
            v_dim=q,
            experts=n_exp,
            top_k=k,
            expert_ffn=ffn,
        ),
    )
    return _ends(c, [layer])


def _deepseek(c: Config) -> tuple[Group, ...]:
    h, heads = int(c["hidden"]), int(c["heads"])
    nope, rope, v = int(c["qk_nope_head_dim"]), int(c["qk_rope_head_dim"]), int(c["v_head_dim"])
    q_rank, kv_rank = int(c["q_lora_rank"]), int(c["kv_lora_rank"])
    n_exp, k = int(c["routed_experts"]), int(c["experts_per_token"])
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

    def shape(kind: str, **widths: int) -> LayerShape:
        return LayerShape(
            kind,
            h,
            heads=heads,
            q_dim=heads * (nope + rope),
            kv_dim=heads * (nope + rope),
            v_dim=heads * v,
            latent=q_rank + kv_rank + rope,
            ffn=widths.get("ffn", 0),
            experts=widths.get("experts", 0),
            top_k=widths.get("top_k", 0),
            expert_ffn=widths.get("expert_ffn", 0),
            shared_ffn=widths.get("shared_ffn", 0),
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
        layer=shape("dense", ffn=dense_ffn),
    )
    routed = k / n_exp
    experts: list[Weight] = []
    for j in range(n_exp):
        experts += [
            _mat(f"mlp.experts.{j}.gate_proj.weight", ffn, h, active=routed),
            _mat(f"mlp.experts.{j}.up_proj.weight", ffn, h, active=routed),
            _mat(f"mlp.experts.{j}.down_proj.weight", h, ffn, active=routed),
        ]
    shared = int(c["shared_experts"]) * ffn
    moe = Group(
        "moe_layer",
        (
            *attn,
            _mat("mlp.gate.weight", n_exp, h),
            _vec("mlp.gate.e_score_correction_bias", n_exp),
            *experts,
            _mat("mlp.shared_experts.gate_proj.weight", shared, h),
            _mat("mlp.shared_experts.up_proj.weight", shared, h),
            _mat("mlp.shared_experts.down_proj.weight", h, shared),
        ),
        count=int(c["layers"]) - int(c["first_dense_layers"]),
        layer=shape("moe", experts=n_exp, top_k=k, expert_ffn=ffn, shared_ffn=shared),
    )
    return _ends(c, [dense, moe])


def _qwen_moe(c: Config) -> tuple[Group, ...]:
    h, hd = int(c["hidden"]), int(c["head_dim"])
    ffn, n_exp, k = int(c["expert_ffn"]), int(c["experts"]), int(c["experts_per_token"])
    q, kv = int(c["heads"]) * hd, int(c["kv_heads"]) * hd
    routed = k / n_exp
    experts: list[Weight] = []
    for j in range(n_exp):
        experts += [
            _mat(f"mlp.experts.{j}.gate_proj.weight", ffn, h, active=routed),
            _mat(f"mlp.experts.{j}.up_proj.weight", ffn, h, active=routed),
            _mat(f"mlp.experts.{j}.down_proj.weight", h, ffn, active=routed),
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
        layer=LayerShape(
            "moe",
            h,
            heads=int(c["heads"]),
            q_dim=q,
            kv_dim=kv,
            v_dim=q,
            experts=n_exp,
            top_k=k,
            expert_ffn=ffn,
            qk_norm=bool(c.get("qk_norm", False)),
        ),
    )
    return _ends(c, [layer])


MODELS = ("llama3-8b", "llama3-70b", "gpt-oss-120b", "deepseek-v3-671b", "qwen3-30b-a3b")

_BUILDERS = {
    "llama3-8b": _llama,
    "llama3-70b": _llama,
    "gpt-oss-120b": _gpt_oss,
    "deepseek-v3-671b": _deepseek,
    "qwen3-30b-a3b": _qwen_moe,
}


def catalogue_model(name: str, overrides: Config | None = None) -> Model:
    """The model ``name`` (one of ``MODELS``) with its groups and derived shapes.

    ``overrides`` replaces published hyper-parameters (e.g. ``{"hidden": 256, "layers": 2}``
    for a scaled-down model of the same structure); unknown keys raise ``ValueError``.
    """
    if name not in _BUILDERS:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    config = dict(CONFIGS[name])
    for key, value in (overrides or {}).items():
        if key not in config:
            raise ValueError(
                f"model {name!r} has no hyper-parameter {key!r} to override "
                f"(it has {sorted(config)})"
            )
        flag = isinstance(config[key], bool)
        if not flag and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"override {key}={value!r} of {name!r} must be an int >= 1")
        if flag and not isinstance(value, bool):
            raise ValueError(f"override {key}={value!r} of {name!r} must be a bool")
        config[key] = value
    return Model(name, _BUILDERS[name](config), tuple(sorted(config.items())))
