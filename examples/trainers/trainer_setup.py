"""What the trainer examples (and ``tests/test_trainers_*.py``) need besides the switch: the
CPU setup a GPU launch does by itself, and a small torchtitan model built from its configs.

- ``enable_accelerate_fsdp(accelerator, plugin)``: accelerate turns its FSDP plugin on only
  for accelerator launches (``MULTI_GPU`` and the like); on a CPU launch it stops at
  ``MULTI_CPU``. This does what its ``AcceleratorState`` does on a GPU launch, so that
  ``accelerator.prepare`` applies ``fully_shard`` on CPU and gloo too. Not needed on GPUs.
- ``torchtitan_llama(vocab, seq)``: a 2-layer torchtitan LLaMA-3 from its config classes,
  initialized by its own ``init_states``, with torchtitan's causal SDPA inner attention, which
  runs eagerly on CPU (its language-model default, FlexAttention with per-document masks,
  needs a compiled kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def enable_accelerate_fsdp(accelerator: Any, plugin: Any) -> None:
    """accelerate 1.16's ``AcceleratorState.__init__`` for a launch with an FSDP plugin (its
    branch of the ``MULTI_GPU``-like types), on a CPU launch: the distributed type becomes FSDP,
    the plugin takes the mixed precision, the state holds the plugin, and the partial state
    learns the type."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type is not DistributedType.MULTI_CPU:
        raise ValueError(
            f"enable_accelerate_fsdp is for CPU launches (MULTI_CPU); this one is "
            f"{state.distributed_type}, where accelerate sets FSDP up itself"
        )
    state.distributed_type = DistributedType.FSDP
    if state._mixed_precision != "no":
        plugin.set_mixed_precision(state._mixed_precision)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def torchtitan_llama(vocab: int, seq: int, *, dim: int = 64, layers: int = 2) -> nn.Module:
    """A small torchtitan ``Llama3Model`` (``dim`` wide, 4 heads, 2 KV heads), built on the CPU
    and initialized under ``torch.manual_seed(0)`` (every rank builds the same weights)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
    from torchtitan.models.llama3 import Llama3Model
    from torchtitan.models.llama3.model import Llama3TransformerBlock

    heads = 4
    linear = {"weight": lambda w: nn.init.trunc_normal_(w, std=0.02), "bias": nn.init.zeros_}
    ones = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=seq, theta=500000, scaling="llama")
    blocks = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=2,
                wqkv_param_init=linear,
                wo_param_init=linear,
                inner_attention=ScaledDotProductAttention.Config(),
                fuse_qkv=True,
                rope=rope,
            ),
            feed_forward=make_ffn_config(
                dim=dim, hidden_dim=2 * dim, w1_param_init=linear, w2w3_param_init=linear
            ),
        )
        for _ in range(layers)
    ]
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab, embedding_dim=dim, param_init={"weight": nn.init.normal_}
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=ones),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=linear),
        layers=blocks,
    )
    torch.manual_seed(0)
    model: nn.Module = config.build()
    model.init_states()  # type: ignore[operator]
    return model
