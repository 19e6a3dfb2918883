"""The catalogue's value types: a weight, a layer's shape, a group of layers, a model.

[Note: blocks from row granularity]
A weight is a stack of matrices: ``(R, C)`` is one matrix of ``R`` rows of ``C`` elements, a fused
3-D expert tensor ``[E, h, n]`` is ``E`` matrices of ``h`` rows of ``n`` elements (one per expert,
back to back). A block never straddles two matrices of a stack.
- Rows granularity ``r``: the block is ``gcd(r, h)`` rows of one matrix (``h = R`` for a 2-D
  weight), i.e. ``gcd(r, h) * C`` elements: ``r`` rows for every matrix of the catalogue but a few
  (DeepSeek's 576-row ``kv_a_proj`` gets 64-row blocks at r = 128; GPT-OSS's 2880-row experts get
  64-row blocks at r = 128, never a block across two experts).
- Tile granularity ``t x t`` (FP8 or 8-bit tiles, one scale per tile of each matrix, the last tile
  row of a matrix partial when ``t`` does not divide ``h``): a shard boundary keeps every tile
  whole iff it falls on a tile-row boundary of one matrix. A uniform block does that iff it is
  ``t`` rows when ``t`` divides ``h``, and otherwise only if it is a multiple of the whole matrix
  (any smaller block lands, in some matrix of the stack, inside a tile), so the block is ``t``
  rows if ``t | h``, else ``h`` rows: whole experts for GPT-OSS at 128 x 128 (2880 = 22.5 x 128).
Vectors (1-D norms and biases, per-expert bias tables, attention sinks, the router's score bias)
carry no block structure an optimizer relies on and get block 1.
"""

from __future__ import annotations

import math

import attrs

from shard_planner import TensorSpec

__all__ = ["ENDS", "Group", "LayerShape", "Model", "Weight"]


@attrs.frozen
class Weight:
    """One parameter: its name, shape, and whether it is a matrix (gets row blocks).

    ``active`` is the fraction of tokens that use it (``top_k / experts`` for routed experts,
    1 otherwise): the projection counts FLOPs with it. A 3-D matrix weight is a stack of
    ``shape[0]`` matrices (fused experts).
    """

    name: str
    shape: tuple[int, ...]
    matrix: bool = True
    active: float = 1.0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrix_rows(self) -> int:
        """Rows of one matrix of the stack (``R`` of a 2-D weight, ``h`` of ``[E, h, n]``)."""
        return self.shape[-2] if len(self.shape) >= 2 else 1

    def block(self, rows: int, *, tile: bool = False) -> int:
        """Block in elements for a granularity of ``rows`` rows or ``rows x rows`` tiles;
        ``rows == 0``: no structure (block 1 element, the engine's default)."""
        if not self.matrix or len(self.shape) < 2 or rows == 0:
            return 1
        h, c = self.matrix_rows, self.shape[-1]
        if tile:
            return (rows if h % rows == 0 else h) * c
        return math.gcd(max(rows, 1), h) * c


@attrs.frozen
class LayerShape:
    """What the projection needs of a group beyond its weights (FLOPs and activations).

    ``kind`` is ``"embed"``, ``"head"`` (final norm + output head), ``"dense"`` (attention + MLP)
    or ``"moe"`` (attention + routed experts). Widths are per token: ``q_dim`` query width of all
    heads, ``kv_dim`` key (= value) width, ``v_dim`` the attention output width, ``ffn`` a dense
    MLP's width, ``expert_ffn`` one expert's, ``shared_ffn`` the always-active shared experts'.
    ``latent`` is MLA's compressed widths (q_lora + kv_lora + rope) when the attention is MLA;
    ``qk_norm``: per-head RMSNorm of queries and keys (Qwen3).
    """

    kind: str
    hidden: int
    heads: int = 0
    q_dim: int = 0
    kv_dim: int = 0
    v_dim: int = 0
    ffn: int = 0
    experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    shared_ffn: int = 0
    vocab: int = 0
    latent: int = 0
    qk_norm: bool = False


@attrs.frozen
class Group:
    """Tensors FSDP gathers together, and how many identical such groups the model has."""

    name: str
    weights: tuple[Weight, ...]
    count: int = 1
    layer: LayerShape | None = None

    @property
    def numel(self) -> int:
        return sum(w.numel for w in self.weights)

    def specs(self, rows: int, *, tile: bool = False) -> list[TensorSpec]:
        return [TensorSpec(w.numel, w.block(rows, tile=tile), w.name) for w in self.weights]


@attrs.frozen
class Model:
    name: str
    groups: tuple[Group, ...]
    config: tuple[tuple[str, int | bool], ...] = ()

    @property
    def numel(self) -> int:
        return sum(g.numel * g.count for g in self.groups)

    @property
    def largest_group(self) -> Group:
        return max(self.groups, key=lambda g: (g.numel, len(g.weights)))

    @property
    def layers(self) -> int:
        """Decoder layers (groups other than the embedding and the head)."""
        return sum(g.count for g in self.groups if g.layer is None or g.layer.kind not in ENDS)


ENDS = ("embed", "head")
