"""Blockwise dynamic quantization: the code books, round-trip bounds, edge values, sharding.

Numerics: quantization of a shard against quantization of the whole tensor is the same
arithmetic per block: bitwise.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import optim_blockwise as ob

pytestmark = pytest.mark.numerics


def _max_gap(signed: bool) -> float:
    code = ob.dynamic_map(signed)
    return float((code[1:] - code[:-1]).max())


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_map_shape_and_landmarks(signed: bool) -> None:
    code = ob.dynamic_map(signed)
    assert code.dtype == torch.float32
    assert code.numel() == (255 if signed else 256)
    assert torch.all(code[1:] > code[:-1]), "strictly increasing, no duplicate codes"
    assert float(code.max()) == 1.0
    assert float(code.min()) == (-1.0 if signed else 0.0)
    assert (code == 0).sum() == 1
    if signed:
        assert torch.equal(code, -code.flip(0)), "signed map is symmetric"
    # Dense near 1 (top decade: 64 signed / 128 unsigned levels), seven/eight decades of range.
    top = code[code > 0.1]
    assert top.numel() == (64 if signed else 128)
    smallest = float(code[code > 0].min())
    assert smallest == pytest.approx(1e-6 if signed else 1e-7, rel=1e-5)


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_round_trip_error_bound_per_block(signed: bool, block: int) -> None:
    gen = torch.Generator().manual_seed(block)
    x = (
        torch.randn(3000, generator=gen)
        * torch.logspace(-3, 3, 3000)[torch.randperm(3000, generator=gen)]
    )
    if not signed:
        x = x.abs()
    absmax = ob.block_absmax(x, block)
    codes = ob.quantize_blockwise(x, absmax, block, signed=signed)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    y = ob.dequantize_blockwise(codes, absmax, block, signed=signed)
    nblocks = absmax.numel()
    assert nblocks == math.ceil(3000 / block)
    pad = nblocks * block - 3000
    err = torch.nn.functional.pad((y - x).abs(), (0, pad)).view(nblocks, block).amax(dim=1)
    # Nearest code: error <= half the largest gap of the map, relative to the block's absmax.
    bound = absmax * (_max_gap(signed) / 2) * (1 + 1e-6)
    assert torch.all(err <= bound), f"worst block: err {float((err / bound).max()):.3f}x the bound"
    # The absmax element of each block is exact (the map holds +-1).
    pos = torch.nn.functional.pad(x.abs(), (0, pad)).view(nblocks, block).argmax(dim=1)
    flat = pos + torch.arange(nblocks) * block
    flat = flat[flat < 3000]
    assert torch.equal(y[flat], x[flat])


def test_relative_error_of_large_values_is_small() -> None:
    # Top decade of the signed map: 64 levels over [0.1, 1], so the absolute error is <= 0.9/128
    # of the absmax and the relative error of values above half the absmax <= 1.41%.
    x = torch.linspace(0.1, 1.0, 1000)
    y = ob.dequantize_blockwise(
        ob.quantize_blockwise(x, ob.block_absmax(x, 1000), 1000, signed=True),
        ob.block_absmax(x, 1000),
        1000,
        signed=True,
    )
    assert float((y - x).abs().max()) <= 0.9 / 128 + 1e-7
    upper = x >= 0.5
    assert float(((y - x).abs() / x)[upper].max()) < 0.0141


def test_zero_blocks_round_trip_to_exact_zeros() -> None:
    x = torch.zeros(512)
    x[300] = 2.5
    for signed in (True, False):
        absmax = ob.block_absmax(x, 256)
        assert absmax.tolist() == [0.0, 2.5]
        y = ob.dequantize_blockwise(
            ob.quantize_blockwise(x, absmax, 256, signed=signed), absmax, 256, signed=signed
        )
        assert torch.equal(y, x)


@pytest.mark.parametrize("scale", [1e-38, 1e-30, 1e-10, 1.0, 1e10, 1e30, 5e37])
def test_huge_and_tiny_magnitudes(scale: float) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(1024, generator=gen) * scale).float()
    assert torch.isfinite(x).all()
    absmax = ob.block_absmax(x, 256)
    y = ob.dequantize_blockwise(
        ob.quantize_blockwise(x, absmax, 256, signed=True), absmax, 256, signed=True
    )
    assert torch.isfinite(y).all()
    bound = absmax.repeat_interleave(256) * (_max_gap(True) / 2) * 1.001
    # Subnormal absmaxes lose relative precision in the division; allow one subnormal step.
    tiny = torch.finfo(torch.float32).smallest_normal
    assert torch.all((y - x).abs() <= bound + 2 * tiny * (absmax.repeat_interleave(256) < tiny))


def test_non_finite_values_poison_only_their_block() -> None:
    x = torch.randn(768)
    x[10] = float("nan")
    x[300] = float("inf")
    absmax = ob.block_absmax(x, 256)
    assert math.isnan(absmax[0]) and math.isinf(absmax[1]) and math.isfinite(absmax[2])
    codes = ob.quantize_blockwise(x, absmax, 256, signed=True)
    y = ob.dequantize_blockwise(codes, absmax, 256, signed=True)
    assert torch.isnan(y[:256]).all()
    assert not torch.isfinite(y[256:512]).all()
    ref = ob.dequantize_blockwise(
        ob.quantize_blockwise(x[512:], absmax[2:], 256, signed=True), absmax[2:], 256, signed=True
    )
    assert torch.equal(y[512:], ref), "the finite block is untouched"


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None)
@given(
    n=st.integers(1, 700),
    block=st.sampled_from([1, 3, 16, 64, 256]),
    cut=st.integers(0, 700),
    signed=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_property_shard_with_head_offset_equals_whole(
    n: int, block: int, cut: int, signed: bool, seed: int
) -> None:
    """Quantizing a slice that starts mid-block (given the whole blocks' absmaxes) gives exactly
    the codes of quantizing the whole tensor: the basis of bit-identical sharding."""
    cut = min(cut, n)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    if not signed:
        x = x.abs()
    whole_absmax = ob.block_absmax(x, block)
    whole = ob.quantize_blockwise(x, whole_absmax, block, signed=signed)
    part = x[cut:]
    head = cut % block
    first, last = cut // block, math.ceil(n / block)
    part_absmax = whole_absmax[first:last] if part.numel() else whole_absmax[:0]
    codes = ob.quantize_blockwise(part, part_absmax, block, signed=signed, head=head)
    assert torch.equal(codes, whole[cut:])
    back = ob.dequantize_blockwise(codes, part_absmax, block, signed=signed, head=head)
    assert torch.equal(
        back, ob.dequantize_blockwise(whole, whole_absmax, block, signed=signed)[cut:]
    )
    # A shard's own partial absmax is a lower bound of the whole block's.
    local = ob.block_absmax(part, block, head)
    assert torch.all(local <= part_absmax)


@pytest.mark.parametrize("signed", [True, False])
def test_table_lookup_equals_binary_search_nearest_code(signed: bool) -> None:
    """The bucketed lookup returns exactly ``searchsorted(midpoints, x)`` everywhere, including
    exactly on midpoints and one ulp either side of them."""
    from optim_blockwise._private.quant import _map_and_midpoints, nearest_code

    code, mid = _map_and_midpoints(signed, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    xs = [
        torch.rand(200_000, generator=gen),
        torch.logspace(-12, 0, 100_000),
        mid,
        torch.nextafter(mid, torch.full_like(mid, 2.0)),
        torch.nextafter(mid, torch.full_like(mid, -2.0)),
        code,
        torch.tensor([0.0, 1.0, 1e-45, 1e-38]),
    ]
    x = torch.cat(xs).clamp(-1, 1)
    x = torch.cat([x, -x]) if signed else x.abs()
    assert torch.equal(nearest_code(x, signed), torch.searchsorted(mid, x))
