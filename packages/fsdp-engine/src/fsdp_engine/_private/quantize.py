"""Blockwise weight quantization for the all-gather: FP8 e4m3 and int8, one fp32 scale per block.

[Note: blockwise quantization]
A weight is read as a matrix, its *panel* of ``rows x width`` elements (see ``panel_shape``), cut
into ``br x bc`` blocks from the top-left corner; the last row and column of blocks may be
partial. DeepSeek-V3's weight format is ``(128, 128)`` tiles; ``(1, 128)`` row blocks are the
activation-style format. Block ``t`` gets one fp32 scale and each of its elements one code::

    amax_t = max |w_ij|  over the block              (exact: a max rounds nothing)
    s_t    = amax_t / Q, or 1 where that is 0        (Q = 448 for e4m3, 127 for int8)
    q_ij   = cast(clamp(w_ij / s_t, -Q, Q))          (e4m3: round to nearest even;
                                                      int8: round half to even)
    w'_ij  = fp32(q_ij) * s_t, rounded once to the compute dtype

Every step is exact (abs, max, clamp, the code's widening to fp32) or one correctly rounded IEEE
operation on one element (the division, the product, the narrowing casts). So an element's code
depends only on its own value and its block's amax, and its dequantized value only on its code
and that scale: not on which other blocks were quantized with it, on vector widths or on thread
counts.

[Note: a shard quantizes exactly its own tiles]
Hence: if a rank's share of a weight is a whole number of block rows (``br * width`` contiguous
elements of the row-major storage, which the engine's block policy makes the planner guarantee),
``quantize_panel`` of the share gives, bit for bit, the rows of codes and the rows of scales that
``quantize_panel`` of the whole weight gives for those elements, and ``dequantize_panel`` of them
the same values. Each rank quantizes its own shard; the gathered result equals quantizing the
gathered tensor. A share that cut a block would see only part of the block's amax: a different
scale. Shares are never cut inside a block row, so no share ever sees a partial block except
the weight's own last row or column of blocks, which the whole weight sees the same way.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "FORMATS",
    "Format",
    "code_dtype",
    "dequantize_panel",
    "dequantize_panels",
    "panel_block_elements",
    "panel_shape",
    "qmax",
    "quantize_panel",
    "quantize_panels",
    "scale_grid",
]

Format = Literal["float8_e4m3fn", "int8"]
FORMATS: tuple[Format, ...] = ("float8_e4m3fn", "int8")


def code_dtype(fmt: Format) -> torch.dtype:
    """The dtype of one code: ``torch.float8_e4m3fn`` or ``torch.int8`` (one byte either way)."""
    return torch.float8_e4m3fn if fmt == "float8_e4m3fn" else torch.int8


def qmax(fmt: Format) -> float:
    """The largest code magnitude Q: e4m3fn's largest finite value (448), or 127 for int8
    (symmetric: -128 is never used, so negation is exact)."""
    return float(torch.finfo(torch.float8_e4m3fn).max) if fmt == "float8_e4m3fn" else 127.0


def panel_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The matrix ``(rows, width)`` whose ``block``-sized tiles a weight of ``shape`` is cut into.

    A weight of any rank is the matrix ``(prod(shape[:-1]), shape[-1])`` (a 1-D weight is one
    row). For row blocks (``br == 1``) whose width divides the row, ``(numel / bc, bc)`` is the
    same set of blocks in the same order (each row is ``width / bc`` consecutive blocks); with
    it a share may start inside a row, at any block, which leaves the planner more freedom.
    """
    br, bc = block
    cols = shape[-1] if shape else 1
    numel = math.prod(shape)
    if br == 1 and cols % bc == 0 and numel:
        return numel // bc, bc
    return (numel // cols if cols else 0), cols


def scale_grid(rows: int, width: int, block: tuple[int, int]) -> tuple[int, int]:
    """How many blocks tile a ``rows x width`` panel: ``(ceil(rows / br), ceil(width / bc))``."""
    br, bc = block
    return -(-rows // br), -(-width // bc)


def panel_block_elements(shape: tuple[int, ...], block: tuple[int, int]) -> int:
    """The planner's block for a quantized weight, in elements: one row of blocks
    (``br * width``), so that every shard boundary falls between block rows.

    When ``br`` does not divide the panel's rows the last block row is shorter; a block that
    divides ``numel`` and whose multiples all fall between block rows then does not exist (the
    planner's blocks are uniform), so the whole weight is one block: it is never cut.
    """
    rows, width = panel_shape(shape, block)
    br = block[0]
    if rows % br == 0:
        return br * width
    return math.prod(shape)


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``x`` (2-D) padded with zeros at the end to ``rows x cols``; ``x`` itself if it fits."""
    pad_rows, pad_cols = rows - x.shape[0], cols - x.shape[1]
    if pad_rows == 0 and pad_cols == 0:
        return x
    return F.pad(x, (0, pad_cols, 0, pad_rows))


def quantize_panel(
    x: torch.Tensor,
    block: tuple[int, int],
    fmt: Format,
    *,
    codes: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes ``(rows, width)`` and fp32 scales ``scale_grid(rows, width, block)`` of the panel
    ``x`` ([Note: blockwise quantization]); the arithmetic is fp32 whatever ``x``'s dtype.

    ``codes`` / ``scales``, if given, receive the results (e.g. views of a send buffer; ``codes``
    of ``code_dtype(fmt)``, or any dtype the codes are cast into exactly).
    """
    rows, width = x.shape
    br, bc = block
    tr, tc = scale_grid(rows, width, block)
    q = qmax(fmt)
    # Zero padding never changes an amax (|w| >= 0), so partial blocks need no special case.
    tiles = _padded(x.float(), tr * br, tc * bc).view(tr, br, tc, bc)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = amax / q
    scale.masked_fill_(scale == 0, 1.0)  # an all-zero (or denormal) block: codes 0, any scale
    scaled = (tiles / scale[:, None, :, None]).clamp_(-q, q)
    if fmt == "int8":
        scaled.round_()  # half to even; the cast to int8 below is then exact
    scaled_2d = scaled.view(tr * br, tc * bc)[:rows, :width]
    if codes is None:
        codes = scaled_2d.to(code_dtype(fmt))
    else:
        codes.copy_(scaled_2d)
    if scales is None:
        scales = scale
    else:
        scales.copy_(scale)
    return codes, scales


def dequantize_panel(
    codes: torch.Tensor,
    scales: torch.Tensor,
    block: tuple[int, int],
    *,
    out: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The panel ``fp32(codes) * scale`` of each element's block, rounded once to ``out``'s
    dtype (or ``dtype``); written into ``out`` (a ``(rows, width)`` tensor) when given."""
    rows, width = codes.shape
    br, bc = block
    tr, tc = scales.shape
    if (tr, tc) != scale_grid(rows, width, block):
        raise ValueError(
            f"dequantize_panel: {tuple(scales.shape)} scales for a {rows}x{width} panel of "
            f"{br}x{bc} blocks, expected {scale_grid(rows, width, block)}"
        )
    if out is None:
        out = torch.empty(rows, width, dtype=dtype, device=codes.device)
    wide = codes.float()
    scale = scales.float()[:, None, :, None]
    if rows == tr * br and width == tc * bc:  # whole blocks: write in place, no temporary
        torch.mul(wide.view(tr, br, tc, bc), scale, out=out.view(tr, br, tc, bc))
        return out
    product = _padded(wide, tr * br, tc * bc).view(tr, br, tc, bc) * scale
    out.copy_(product.view(tr * br, tc * bc)[:rows, :width])  # fp32 product, rounded once here
    return out


# [Note: the pieces of a group at once]
# A group's quantized all-gather encodes and decodes many pieces (every rank's share of every
# weight). Launching the panel functions per piece makes the launches per group grow with its
# parameters. The batched forms below take the pieces of whole blocks with the same width
# together: their row-major panels concatenated along the rows are one panel of whole blocks
# (every piece is a whole number of block rows), quantized or dequantized by one chain of
# kernels, and the results go back to every piece with one ``_foreach_copy_`` of contiguous
# tensors of one dtype. Each element meets the same operations as in the panel functions
# ([Note: blockwise quantization]: its code depends only on its value and its block's amax), so
# the results are bitwise those of the panel functions. Pieces with a partial block (a weight's
# last block row or column) take the panel functions, one each.


def _whole(rows: int, width: int, block: tuple[int, int]) -> bool:
    return rows % block[0] == 0 and width % block[1] == 0


def quantize_panels(
    panels: list[torch.Tensor],
    block: tuple[int, int],
    fmt: Format,
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
) -> None:
    """``quantize_panel(panels[i], codes=codes[i], scales=scales[i])`` for every ``i``, bitwise
    the same, with kernel launches per width, not per panel ([Note: the pieces of a group at
    once]). ``codes[i]``: contiguous ``(rows, width)`` of ``code_dtype(fmt)``; ``scales[i]``:
    contiguous fp32 ``scale_grid``."""
    br, bc = block
    q = qmax(fmt)
    widths: dict[int, list[int]] = {}
    for i, x in enumerate(panels):
        rows, width = x.shape
        if _whole(rows, width, block) and codes[i].dtype == code_dtype(fmt):
            widths.setdefault(width, []).append(i)
        else:
            quantize_panel(x, block, fmt, codes=codes[i], scales=scales[i])
    for width, members in widths.items():
        tc = width // bc
        x = torch.cat([panels[i] for i in members]).float()
        tiles = x.view(-1, br, tc, bc)
        scale = tiles.abs().amax(dim=(1, 3))
        scale = scale / q
        scale.masked_fill_(scale == 0, 1.0)
        scaled = (tiles / scale[:, None, :, None]).clamp_(-q, q)
        if fmt == "int8":
            scaled.round_()
        coded = scaled.view(-1, width).to(code_dtype(fmt))
        heights = [int(panels[i].shape[0]) for i in members]
        torch._foreach_copy_([codes[i] for i in members], list(torch.split(coded, heights)))
        scale_heights = [h // br for h in heights]
        torch._foreach_copy_([scales[i] for i in members], list(torch.split(scale, scale_heights)))


def dequantize_panels(
    codes: list[torch.Tensor],
    scales: list[torch.Tensor],
    block: tuple[int, int],
    out: list[torch.Tensor],
) -> None:
    """``dequantize_panel(codes[i], scales[i], out=out[i])`` for every ``i``, bitwise the same,
    with kernel launches per width and output dtype, not per panel ([Note: the pieces of a
    group at once]). ``out[i]``: contiguous ``(rows, width)``."""
    br, bc = block
    classes: dict[tuple[int, torch.dtype], list[int]] = {}
    for i, c in enumerate(codes):
        rows, width = c.shape
        if _whole(rows, width, block) and scales[i].shape == scale_grid(rows, width, block):
            classes.setdefault((width, out[i].dtype), []).append(i)
        else:
            dequantize_panel(c, scales[i], block, out=out[i])
    for (width, dtype), members in classes.items():
        tc = width // bc
        wide = torch.cat([codes[i] for i in members]).float().view(-1, br, tc, bc)
        scale = torch.cat([scales[i] for i in members]).float()
        product = (wide * scale[:, None, :, None]).view(-1, width).to(dtype)  # rounded once
        heights = [int(codes[i].shape[0]) for i in members]
        torch._foreach_copy_([out[i] for i in members], list(torch.split(product, heights)))
