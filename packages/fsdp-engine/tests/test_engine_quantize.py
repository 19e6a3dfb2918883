"""The blockwise quantization maths of the quantized all-gather (``fsdp_engine._private.quantize``).

Two kinds of numeric test (stated per test): *same arithmetic* (the same functions on the same
elements, compared bitwise: every step is exact or one correctly rounded IEEE operation per
element, so splitting, vector width and thread count cannot change a bit) and *different
arithmetic* (dequantized against the original weights, within the error bound of the format,
derived in the test). Example counts from ``FUZZ_EXAMPLES``.
"""

from __future__ import annotations

import itertools
import math
import os
from typing import Any, cast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdp_engine._private.quantize import (
    FORMATS,
    code_dtype,
    dequantize_panel,
    dequantize_panels,
    panel_block_elements,
    panel_shape,
    qmax,
    quantize_panel,
    quantize_panels,
    scale_grid,
)

pytestmark = pytest.mark.numerics
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
BLOCKS = [(128, 128), (1, 128), (4, 8), (1, 8), (3, 5), (2, 1)]


def _weights(shape: tuple[int, ...], seed: int, spread: float) -> torch.Tensor:
    """Normal weights whose magnitudes vary by ``10**spread`` across rows (blocks differ)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen)
    rows = w.reshape(-1, shape[-1])
    rows *= torch.logspace(-spread, spread, rows.shape[0])[:, None]
    return w


@st.composite
def cases(draw: Any) -> tuple[tuple[int, ...], tuple[int, int], str, list[int], int]:
    """A weight shape, a block, a format, and cut points between block rows (an uneven split
    into shares, empty shares included)."""
    block = draw(st.sampled_from(BLOCKS))
    small = block[1] <= 8
    cols = draw(st.integers(1, 20 if small else 300))
    rows = draw(st.integers(1, 24 if small else 300))
    shape = (rows, cols) if draw(st.booleans()) else (draw(st.integers(1, 3)), rows, cols)
    prows, width = panel_shape(shape, block)
    unit = block[0] * width
    numel = math.prod(shape)
    # cuts anywhere between block rows; the last block row may be partial
    count = -(-prows // block[0])
    cuts = sorted([*draw(st.lists(st.integers(0, count), max_size=4)), 0, count])
    bounds = [min(c * unit, numel) for c in cuts]
    return shape, block, draw(st.sampled_from(FORMATS)), bounds, draw(st.integers(0, 2**16))


@settings(max_examples=EXAMPLES, deadline=None)
@given(cases())
def test_shares_quantize_exactly_their_own_blocks(case: Any) -> None:
    """Same arithmetic: quantizing each share of a block-row-aligned split (uneven, empty shares
    allowed) and concatenating gives the codes and scales of the whole weight, bit for bit, and
    dequantizing each share gives the whole weight's dequantized values."""
    shape, block, fmt, bounds, seed = case
    torch.set_num_threads(1)
    w = _weights(shape, seed, spread=3.0)
    rows, width = panel_shape(shape, block)
    codes, scales = quantize_panel(w.reshape(rows, width), block, fmt)
    full = dequantize_panel(codes, scales, block, dtype=torch.bfloat16).reshape(-1)
    flat = w.reshape(-1)
    got_codes, got_scales, got_values = [], [], []
    for lo, hi in itertools.pairwise(bounds):
        if lo == hi:
            continue
        share = flat[lo:hi].view(-1, width)
        c, s = quantize_panel(share, block, fmt)
        got_codes.append(c.reshape(-1))
        got_scales.append(s.reshape(-1))
        got_values.append(dequantize_panel(c, s, block, dtype=torch.bfloat16).reshape(-1))
    assert torch.equal(torch.cat(got_codes).view(torch.uint8), codes.reshape(-1).view(torch.uint8))
    assert torch.equal(torch.cat(got_scales), scales.reshape(-1))
    assert torch.equal(torch.cat(got_values), full)


def test_a_cut_block_changes_the_scale() -> None:
    """Same arithmetic: the property needs whole block rows. A share boundary inside a block row
    lets each side see a different amax, and the codes and scales differ from the whole
    weight's."""
    w = torch.ones(8, 8)
    w[0, 0] = 100.0  # the first 4x8 block's amax, seen only by the first half of its rows
    c, s = quantize_panel(w, (4, 8), "float8_e4m3fn")
    c_top, _ = quantize_panel(w[:2], (4, 8), "float8_e4m3fn")
    c_rest, s_rest = quantize_panel(w[2:], (4, 8), "float8_e4m3fn")
    fp32 = torch.tensor([100.0, 1.0]) / 448  # the scales in fp32 arithmetic
    assert float(s[0, 0]) == float(fp32[0])
    assert float(s_rest[0, 0]) == float(fp32[1])  # rows 2..5 without the outlier
    assert not torch.equal(torch.cat([c_top, c_rest]).view(torch.uint8), c.view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("block", [(128, 128), (1, 128), (3, 5)])
def test_dequantized_error_within_the_format_bound(fmt: str, block: tuple[int, int]) -> None:
    """Different arithmetic: the dequantized weight against the original.

    With s the block's scale and x = w / s (|x| <= Q by construction): int8 rounds x to an
    integer, |x - q| <= 1/2; e4m3 has 3 mantissa bits, so for |x| >= 2^-6 (normal)
    |x - q| <= 2^-4 |x| and below it (subnormal, spacing 2^-9) |x - q| <= 2^-10. The division and
    the product each add one fp32 rounding (relative 2^-24) and the final fp32 result is exact.
    So |w - w'| <= s * bound(x) + 2 * 2^-24 |w| + 2^-24 |w'|, per element.
    """
    torch.set_num_threads(1)
    w = _weights((300, 260), 7, spread=2.0)
    rows, width = panel_shape(tuple(w.shape), block)
    panel = w.reshape(rows, width)
    codes, scales = quantize_panel(panel, block, fmt)  # type: ignore[arg-type]
    back = dequantize_panel(codes, scales, block, dtype=torch.float32)
    br, bc = block
    each = scales.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :width]
    x = (panel / each).abs()
    if fmt == "int8":
        bound = torch.full_like(x, 0.5)
    else:
        bound = torch.where(x >= 2.0**-6, x * 2.0**-4, torch.full_like(x, 2.0**-10))
    eps = 2.0**-24
    limit = each * bound + 2 * eps * panel.abs() + eps * back.abs()
    assert bool(((back - panel).abs() <= limit).all())
    assert float(codes.float().abs().max()) <= qmax(fmt)  # type: ignore[arg-type]
    # each block's largest element maps to (nearly) the top of the code range
    assert float(codes.float().abs().max()) >= qmax(fmt) * (1 - 2.0**-4)  # type: ignore[arg-type]


def test_zero_blocks_and_the_code_dtypes() -> None:
    """An all-zero block gets scale 1 and codes 0 (no 0/0); codes are one byte each."""
    w = torch.zeros(4, 16)
    w[:, 8:] = torch.arange(32, dtype=torch.float32).view(4, 8) - 16
    for fmt in FORMATS:
        codes, scales = quantize_panel(w, (4, 8), fmt)  # type: ignore[arg-type]
        assert codes.dtype == code_dtype(fmt) and codes.element_size() == 1  # type: ignore[arg-type]
        assert scales.dtype == torch.float32 and tuple(scales.shape) == (1, 2)
        assert float(scales[0, 0]) == 1.0
        assert not bool(codes[:, :8].float().any())
        expected = torch.tensor(16.0) / qmax(fmt)  # type: ignore[arg-type]
        assert float(scales[0, 1]) == float(expected)


def test_panel_geometry() -> None:
    """The matrix view, the scale grid and the planner block of a few weights."""
    assert panel_shape((384, 256), (128, 128)) == (384, 256)
    assert panel_block_elements((384, 256), (128, 128)) == 128 * 256  # one row of tiles
    assert panel_shape((384, 256), (1, 128)) == (768, 128)  # row blocks: any 128 elements
    assert panel_block_elements((384, 256), (1, 128)) == 128
    assert panel_shape((10, 100), (1, 128)) == (10, 100)  # a row is one partial block
    assert panel_block_elements((10, 100), (1, 128)) == 100
    assert panel_block_elements((103, 256), (128, 128)) == 103 * 256  # partial: kept whole
    assert panel_shape((2, 3, 256), (128, 128)) == (6, 256)
    assert scale_grid(300, 260, (128, 128)) == (3, 3)


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "int8"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_batched_pieces_bitwise_equal_to_one_panel_each(fmt: str, out_dtype: torch.dtype) -> None:
    """``quantize_panels`` / ``dequantize_panels`` (a group's pieces at once, [Note: the pieces
    of a group at once]) give bitwise what ``quantize_panel`` / ``dequantize_panel`` give one
    piece at a time: pieces of two widths, zero and tiny blocks, and partial blocks (which take
    the per-panel path)."""
    block = (4, 8)
    torch.manual_seed(3)
    shapes = [(8, 16), (4, 16), (12, 24), (8, 16), (5, 16), (8, 20), (4, 24)]
    panels = [torch.randn(s) * 10 ** torch.randint(-6, 4, (1,)).item() for s in shapes]
    panels[1].zero_()
    panels[3][:4] = 1e-42  # denormal blocks: scale 1
    fmt_ = cast(Any, fmt)
    expected = [quantize_panel(x, block, fmt_) for x in panels]
    codes = [torch.empty(s, dtype=code_dtype(fmt_)) for s in shapes]
    scales = [torch.empty(scale_grid(*s, block)) for s in shapes]
    quantize_panels(panels, block, fmt_, codes, scales)
    for (c, s), c2, s2 in zip(expected, codes, scales, strict=True):
        assert torch.equal(c.view(torch.uint8), c2.view(torch.uint8))
        assert torch.equal(s, s2)
    outs = [torch.empty(s, dtype=out_dtype) for s in shapes]
    dequantize_panels(codes, scales, block, outs)
    for (c, s), out in zip(expected, outs, strict=True):
        want = dequantize_panel(c, s, block, dtype=out_dtype)
        assert torch.equal(want.view(-1).view(torch.uint8), out.view(-1).view(torch.uint8))
