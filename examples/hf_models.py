"""Hugging Face ``transformers`` causal LMs on ``fully_shard``: configs, sharding, compile, export.

Shared by ``hf_train.py`` and the ``hf`` test session (one copy). ``transformers`` and
``safetensors`` are the examples' optional extra ``hf`` (``pip install -e "examples[hf]"``,
pinned in ``examples/pyproject.toml``), never a dependency of a package. Models are built from
configs with random init: nothing is downloaded.

- ``make_config(name, vocab=, seq=)``: small configs (2 layers, hidden 128) of
  ``LlamaForCausalLM`` with ``tie_word_embeddings=True`` (``"llama"``), ``Qwen3MoeForCausalLM``
  whose experts run HF's eager loop that skips experts without tokens (``"moe"``), and
  ``GptOssForCausalLM`` (``"gpt-oss"``, where the installed transformers has it).
- ``shard_model(model, fully_shard, mesh=)``: the torchtitan way, every decoder layer, then the
  root; ``fully_shard`` is ours or torch's (the same signature).
- ``compile_layers(model)``: ``torch.compile`` of each decoder layer *before* ``fully_shard``
  (torchtitan's ``apply_compile``: the compiled wrapper replaces the layer, so the sharding hooks
  run outside the compiled graph).
- ``export_pretrained(checkpoint, out_dir)``: a sharded checkpoint (any world size) to a
  ``save_pretrained`` directory (safetensors) that ``AutoModelForCausalLM.from_pretrained``
  loads. Command line: ``python examples/hf_models.py export CHECKPOINT OUT_DIR``.

[Note: data independent of the world size]
``global_batch(corpus, step, ...)`` draws the whole step's batch from a generator seeded by the
step, and each rank takes its rows (``rank_rows``). The global batch is then the same at every
world size, so a run resumed at another world size, or one process on the whole batch, sees the
same data and reaches the same losses (up to the order of the cross-rank gradient sum).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from llama import Corpus
from torch import nn

__all__ = [
    "HF_MODELS",
    "INSTALL",
    "require_transformers",
    "available_models",
    "make_config",
    "build_model",
    "decoder_layers",
    "shard_model",
    "compile_layers",
    "split_experts",
    "lm_loss",
    "global_batch",
    "rank_rows",
    "checkpoint_metadata",
    "export_pretrained",
]

HF_MODELS = ("llama", "moe", "gpt-oss")
INSTALL = f'pip install -e "{Path(__file__).resolve().parent}[hf]"'  # the pinned extra


def require_transformers() -> Any:
    """The ``transformers`` module, or an ImportError that says how to install the extra."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"the Hugging Face examples need transformers and safetensors: "
            f"{INSTALL} (the pinned versions; the installed torch stays)"
        ) from exc
    return transformers


def available_models() -> tuple[str, ...]:
    """The names of ``HF_MODELS`` that the installed transformers can build."""
    tf = require_transformers()
    return tuple(n for n in HF_MODELS if n != "gpt-oss" or hasattr(tf, "GptOssForCausalLM"))


def make_config(name: str, *, vocab: int, seq: int, layers: int = 2, hidden: int = 128) -> Any:
    """A small config of one of ``HF_MODELS`` (random init, nothing downloaded).

    Attention and experts implementations are chosen explicitly so that the sharded model and
    the model reloaded by ``from_pretrained`` run the same kernels: ``sdpa`` for LLaMA and
    Qwen3-MoE, ``eager`` for GPT-OSS (its attention sinks have no sdpa path); experts run the
    ``eager`` loop over the experts that received tokens (the conditional-compute case).
    """
    tf = require_transformers()
    common: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": seq,
        "use_cache": False,  # training: no KV cache objects in forward
    }
    if name == "llama":
        return tf.LlamaConfig(
            **common,
            intermediate_size=2 * hidden,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
    if name == "moe":
        return tf.Qwen3MoeConfig(
            **common,
            intermediate_size=2 * hidden,
            moe_intermediate_size=hidden // 2,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            tie_word_embeddings=False,
            attn_implementation="sdpa",
            experts_implementation="eager",
        )
    if name == "gpt-oss":
        if not hasattr(tf, "GptOssConfig"):
            raise ValueError(
                f"--hf-model gpt-oss: transformers {tf.__version__} has no GptOssForCausalLM "
                f"(it arrived in 4.55; {INSTALL})"
            )
        return tf.GptOssConfig(
            **common,
            head_dim=hidden // 4,
            intermediate_size=hidden // 2,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2)
            + ["sliding_attention"] * (layers % 2),
            sliding_window=max(seq // 4, 1),
            rope_parameters={"rope_type": "default", "rope_theta": 150000.0},  # no YaRN at seq
            tie_word_embeddings=False,
            attn_implementation="eager",
            experts_implementation="eager",
        )
    raise ValueError(f"unknown Hugging Face model {name!r}: expected one of {HF_MODELS}")


def build_model(config: Any, *, seed: int, device: torch.device | str = "cpu") -> nn.Module:
    """``AutoModelForCausalLM.from_config`` with HF's own random init under ``seed`` (every rank
    builds the same weights), fp32, in training mode."""
    tf = require_transformers()
    torch.manual_seed(seed)
    with torch.device(device):
        model: nn.Module = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    return model


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a ``*ForCausalLM`` (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(
            f"{type(model).__name__} has no model.layers ModuleList: not a decoder-only "
            f"*ForCausalLM of transformers"
        )
    return layers


def shard_model(
    model: nn.Module, fully_shard: Callable[..., Any], *, mesh: Any, **kwargs: Any
) -> nn.Module:
    """Shard the torchtitan way: one ``fully_shard`` per decoder layer, then the root (the
    embedding, the final norm and the head, tied or not, form the root's group)."""
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    return model


def compile_layers(model: nn.Module, **compile_kwargs: Any) -> nn.Module:
    """``torch.compile`` every decoder layer in place of the layer (call before ``fully_shard``).

    As torchtitan's ``apply_compile``: ``torch.compile(layer, **compile_kwargs)`` is registered
    under the layer's name, so ``fully_shard`` then wraps the compiled module and its hooks run
    eagerly around the compiled graph. Parameter names gain an ``_orig_mod`` component, which
    ``fsdp_engine.load_full_state_dict`` (and so ``export_pretrained``) removes.
    """
    layers = decoder_layers(model)
    for index, layer in enumerate(list(layers)):
        layers.register_module(str(index), torch.compile(layer, **compile_kwargs))
    return model


class _Expert(nn.Module):
    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(gate_up.detach().clone())
        self.down_proj = nn.Parameter(down.detach().clone())


class SplitExperts(nn.Module):
    """Qwen3-MoE's experts with one module per expert (transformers 4.x's layout): the same
    eager loop as ``Qwen3MoeExperts``, so an expert that gets no token on a rank gets no gradient
    there (the conditional-compute case FSDP2 aborts on with gloo)."""

    def __init__(self, fused: nn.Module) -> None:
        super().__init__()
        self.num_experts = int(fused.num_experts)
        self.act_fn = fused.act_fn
        gate_up, down = fused.gate_up_proj, fused.down_proj
        self.experts = nn.ModuleList(_Expert(gate_up[e], down[e]) for e in range(self.num_experts))

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
            mask = mask.permute(2, 1, 0)  # (expert, k, token)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero().flatten().tolist()
        for index in hit:
            expert = self.experts[index]
            top_k_pos, token_idx = torch.where(mask[index])
            gate, up = nn.functional.linear(hidden_states[token_idx], expert.gate_up_proj).chunk(
                2, dim=-1
            )
            value = nn.functional.linear(self.act_fn(gate) * up, expert.down_proj)
            value = value * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, value.to(out.dtype))
        return out


def split_experts(model: nn.Module) -> nn.Module:
    """Replace every Qwen3-MoE fused experts module by ``SplitExperts`` (same values, one
    parameter pair per expert). Call before sharding; the result is not ``save_pretrained``
    compatible (the names differ from HF's)."""
    for module in list(model.modules()):
        fused = getattr(module, "experts", None)
        if type(fused).__name__ == "Qwen3MoeExperts":
            module.experts = SplitExperts(fused)
    return model


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """HF's own causal-LM loss (``labels=input_ids``: the model shifts them): the mean
    next-token cross-entropy over the batch."""
    loss: torch.Tensor = model(input_ids=tokens, labels=tokens).loss
    return loss


def global_batch(
    corpus: Corpus, step: int, *, size: int, seq: int, seed: int = 0, split: str = "train"
) -> torch.Tensor:
    """The whole step's batch (``size`` windows of ``seq`` tokens), the same at any world size
    (see [Note: data independent of the world size])."""
    data = corpus.train if split == "train" else corpus.val
    gen = torch.Generator().manual_seed(1_000_003 * (seed + 1) + step)
    starts = torch.randint(0, len(data) - seq, (size,), generator=gen)
    return torch.stack([data[s : s + seq] for s in starts.tolist()])


def rank_rows(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's rows of the global batch (equal parts: the mean of the ranks' mean losses is
    the global mean loss)."""
    if batch.shape[0] % world:
        raise ValueError(
            f"the global batch of {batch.shape[0]} sequences does not split over {world} ranks"
        )
    return batch.chunk(world)[rank]


def checkpoint_metadata(model: nn.Module, **extra: Any) -> dict[str, Any]:
    """What ``export_pretrained`` needs besides the tensors: the HF config (JSON), stored in the
    checkpoint's commit record by ``save_checkpoint(..., metadata=...)``."""
    tf = require_transformers()
    config = model.config
    return {
        "hf_config": json.loads(config.to_json_string(use_diff=False)),
        "transformers": tf.__version__,
        **extra,
    }


def export_pretrained(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    prefix: str = "model.",
    dtype: torch.dtype | None = None,
) -> Path:
    """A committed sharded checkpoint to a ``save_pretrained`` directory (safetensors).

    One process, no process group: ``fsdp_engine.load_full_state_dict`` assembles the full
    tensors from every rank's chunks; the config comes from the checkpoint's metadata
    (``checkpoint_metadata``). The model is built on the meta device (no random init, no second
    copy of the weights), the tensors are assigned, ties re-applied, and ``save_pretrained``
    writes ``config.json`` and ``model.safetensors``. Returns ``out_dir``.
    """
    import fsdp_engine

    tf = require_transformers()
    info = fsdp_engine.checkpoint_info(checkpoint)
    stored = info.get("metadata", {}).get("hf_config")
    if not isinstance(stored, dict):
        raise ValueError(
            f"{os.fspath(checkpoint)!r} has no Hugging Face config in its metadata: save it "
            f"with save_checkpoint(..., metadata=checkpoint_metadata(model))"
        )
    fields = dict(stored)
    config = tf.AutoConfig.for_model(fields.pop("model_type"), **fields)
    state = fsdp_engine.load_full_state_dict(checkpoint, prefix=prefix, dtype=dtype)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    expected = set(model.state_dict())
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {os.fspath(checkpoint)!r} does not match {type(model).__name__}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    out = Path(out_dir)
    model.save_pretrained(out)
    return out


def _main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Hugging Face models on fully_shard")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="sharded checkpoint -> save_pretrained directory")
    export.add_argument("checkpoint")
    export.add_argument("out_dir")
    export.add_argument("--prefix", default="model.", help="the model's key prefix")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    out = export_pretrained(args.checkpoint, args.out_dir, prefix=args.prefix, dtype=dtype)
    print(f"wrote {out} (load with AutoModelForCausalLM.from_pretrained({str(out)!r}))")


if __name__ == "__main__":
    _main()
