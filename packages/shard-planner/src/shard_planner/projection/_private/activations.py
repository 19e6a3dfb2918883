"""Activation memory and FLOPs per token of each catalogue group, by a stated formula.

[Note: the activation formula]
What autograd keeps between forward and backward for one token of one group, in bytes, for the
standard eager implementation of these models (what torchtitan and the HF modelling code do,
with fused kernels where those exist): ``c`` is the compute dtype's size, ``h`` the hidden size.

- embedding: the token id (8 bytes, int64).
- attention block: the normalised input's input ``x`` (``h c``) and its inverse RMS (4, fp32),
  fused RMSNorm; the norm's output, shared by the q/k/v projections (``h c``); the rotated
  queries and keys and the values, kept by flash / memory-efficient attention
  (``(q + 2 kv) c``) with its output (``v c``; the kernels write it token-major, so it is also
  ``o_proj``'s input, no copy) and log-sum-exp (``heads * 4``); with per-head q/k norms (Qwen3)
  their inputs and inverse RMS (``(q + kv) c + 4 (heads + kv_heads)``). MLA (DeepSeek) also keeps
  its compressed latents and their norms (``2 * latent * c``). Biases and rotary embeddings keep
  nothing per token.
- dense MLP (SwiGLU): the norm's ``x`` and RMS and output (``2 h c + 4``); gate and up
  projections, the SiLU output and the product (``4 f c``).
- routed MoE (token choice, top ``k`` of ``E``): the norm as above; the router's softmax output
  (``E c``), the chosen experts (``k * 8``), their weights and the sum normalising them
  (``(k + 1) c``); per routed copy of the token (``k`` of them) the gathered input row, the
  expert's gate, up, SiLU output and product, its output before the gate weight and that weight
  (``(2 h + 4 f_e + 1) c``) with the token and slot indices (16); shared experts as a dense MLP
  of width ``f_s``.
- output head: the final norm (``2 h c + 4``), the logits in fp32 and their log-softmax
  (``2 * vocab * 4``; the loss is taken in fp32).

Sums over the ``k`` routed copies are exact whatever the routing (every token is routed ``k``
times), so no load-balance assumption enters. With full activation checkpointing a layer keeps
only its input (``h c``) and recomputes the rest in its backward.

[Note: the backward working set]
While one group's backward runs, besides what the forward kept: the gradient arriving from above
and the one leaving (``2 h c`` per token), and the largest set of gradients alive inside the
block at once: for a dense MLP the gradients of the product, the SiLU output and the gate
(``3 f c``), for routed experts the same per routed copy (``3 k f_e c``), for attention
``(q + 2 kv + v) c``; for the head the fp32 gradient of the log-probabilities beside the kept
log-softmax output (``vocab * 4``; autograd frees each before the next, larger one is made). A fused
3-D expert tensor used one expert at a time (a view per expert, as grouped GEMMs and HF's loop do)
gets its gradient in per-expert pieces that are put together once all experts are done: the whole
tensor's gradient in the compute dtype is alive before it reaches the gradient storage (per group,
not per token).
"""

from __future__ import annotations

from shard_planner.projection._private.catalogue import Group, LayerShape

__all__ = [
    "activation_bytes",
    "backward_work_bytes",
    "forward_flops",
    "fused_gradient_bytes",
    "layer_input_bytes",
]

_INDEX = 8  # int64
_FP32 = 4


def _attention(s: LayerShape, c: int) -> int:
    kept = 2 * s.hidden * c + _FP32  # norm input, inverse RMS, norm output
    kept += (s.q_dim + 2 * s.kv_dim) * c  # rotated q, k and v for the attention kernel
    kept += s.v_dim * c + s.heads * _FP32  # its output (token-major: o_proj's input), LSE
    if s.qk_norm:  # per-head RMSNorm of q and k keeps their inputs and inverse RMS
        kept += (s.q_dim + s.kv_dim) * c + (s.heads + s.kv_dim * s.heads // s.q_dim) * _FP32
    return kept + 2 * s.latent * c


def _mlp(s: LayerShape, c: int) -> int:
    kept = 2 * s.hidden * c + _FP32  # the second norm
    if s.kind == "dense":
        return kept + 4 * s.ffn * c
    # router softmax output, chosen experts, their weights and the sum that normalises them
    kept += s.experts * c + s.top_k * _INDEX + (s.top_k + 1) * c
    # per routed copy: input row, gate/up/SiLU/product, output, its weight, token and slot
    kept += s.top_k * ((2 * s.hidden + 4 * s.expert_ffn + 1) * c + 2 * _INDEX)
    return kept + 4 * s.shared_ffn * c


def activation_bytes(group: Group, compute_bytes: int, *, checkpointing: bool = False) -> int:
    """Bytes kept for backward per token by one instance of ``group`` (module Note)."""
    s = group.layer
    if s is None:
        return 0
    c = compute_bytes
    if s.kind == "embed":
        return _INDEX
    if s.kind == "head":
        return 2 * s.hidden * c + _FP32 + 2 * s.vocab * _FP32
    if checkpointing:
        return layer_input_bytes(group, c)
    return _attention(s, c) + _mlp(s, c)


def layer_input_bytes(group: Group, compute_bytes: int) -> int:
    s = group.layer
    return 0 if s is None else s.hidden * compute_bytes


def backward_work_bytes(group: Group, compute_bytes: int) -> int:
    """Transient gradient bytes per token while this group's backward runs (module Note)."""
    s = group.layer
    if s is None or s.kind == "embed":
        return 0
    c = compute_bytes
    if s.kind == "head":
        return s.vocab * _FP32 + 2 * s.hidden * c
    inner = 3 * (s.ffn if s.kind == "dense" else s.top_k * s.expert_ffn + s.shared_ffn) * c
    attention = (s.q_dim + 2 * s.kv_dim + s.v_dim) * c
    return 2 * s.hidden * c + max(inner, attention)


def attention_part(group: Group, compute_bytes: int) -> tuple[int, int]:
    """Per token, a decoder layer's attention half (its first in forward, last in backward): the
    activations it keeps and its backward working set; ``(0, 0)`` for the ends. While it runs
    backward, autograd has already made the MLP's gradients and freed the MLP's activations."""
    s = group.layer
    if s is None or s.kind in ("embed", "head"):
        return 0, 0
    c = compute_bytes
    return _attention(s, c), 2 * s.hidden * c + (s.q_dim + 2 * s.kv_dim + s.v_dim) * c


def second_half_numel(group: Group) -> int:
    """Parameters of a decoder layer's MLP half (post-attention norm, MLP or experts): their
    gradients exist while the attention half runs backward."""
    if group.layer is None or group.layer.kind in ("embed", "head"):
        return 0
    return sum(w.numel for w in group.weights if w.name.startswith(_SECOND_HALF))


_SECOND_HALF = ("mlp.", "post_attention_layernorm.")


def fused_gradient_bytes(group: Group, compute_bytes: int) -> int:
    """Per group instance, not per token: the gradients of fused 3-D expert tensors, whole,
    alive before they are added into the gradient storage (module Note)."""
    return sum(w.numel for w in group.weights if w.matrix and len(w.shape) == 3) * compute_bytes


def forward_flops(group: Group, seq: int) -> float:
    """Forward FLOPs per token: ``2 x`` the active matrix weights (the embedding is a lookup),
    plus causal attention over ``seq`` positions: ``q k^T`` and ``p v`` cost ``2 seq (d_qk + d_v)``
    per token on the full square, half of it under the causal mask."""
    s = group.layer
    weights = 0.0
    for w in group.weights:
        if w.matrix and not (s is not None and s.kind == "embed"):
            weights += w.numel * w.active
    flops = 2.0 * weights
    if s is not None and s.heads:
        flops += seq * (s.q_dim + s.v_dim)
    return flops
