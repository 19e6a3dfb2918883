"""Blockwise dynamic 8-bit quantization (Dettmers et al. 2022, block-wise 8-bit optimizers).

[Note: the dynamic tree map]
A code is a sign bit (signed map only), then a run of ``k`` zero bits that picks the decade
``[10^-(k+1), 10^-k]``, an indicator 1 bit, and the remaining ``f`` bits as a linear fraction
inside that decade (``2^f`` levels, the upper end of each of ``2^f`` equal sub-intervals of
``[0.1, 1] * 10^-k``). Fewer fraction bits are left the smaller the magnitude, so the map is dense
near 1 (relative error ~0.7%) and spans seven (signed) or eight (unsigned) decades. With the
upper-endpoint levels both +1 and -1 are exact codes, so a block's absmax element round-trips
exactly, and 0 is exact.

- unsigned (for Adam's second moment ``v >= 0``): ``k = 0..7`` with ``f = 7 - k`` fraction bits:
  ``128 + 64 + ... + 1 = 255`` positive levels plus 0: all 256 codes.
- signed (for the first moment ``m``): ``k = 0..6`` with ``f = 6 - k``: 127 magnitudes per sign,
  plus 0: 255 codes, symmetric; the 256th code is unused (bitsandbytes spends it on an asymmetric
  extra level, we prefer the exact ±1).

Quantization of a block ``x`` is ``code = argmin_c |x / absmax(x) - map[c]|``, found with a
``searchsorted`` over the midpoints of the sorted map (ties go to the smaller code), and
dequantization is ``map[code] * absmax``. Every operation is elementwise given the block's absmax,
and a max is exact and order-free, so quantizing a shard that holds whole blocks gives exactly
the codes of quantizing the whole tensor: this is what makes sharded 8-bit Adam bit-identical to
the single-device one.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "dynamic_map",
    "quantize_blockwise",
    "dequantize_blockwise",
    "block_absmax",
]


@functools.cache
def _dynamic_map_values(signed: bool) -> tuple[float, ...]:
    magnitude_bits = 7 if signed else 8
    levels: list[float] = [0.0]
    for k in range(magnitude_bits):  # k = number of leading zero bits = decade
        fraction_bits = magnitude_bits - 1 - k
        count = 2**fraction_bits
        scale = 10.0 ** (-k)
        # Upper endpoints of `count` equal sub-intervals of [0.1, 1]: 0.1 + 0.9 * j / count.
        for j in range(1, count + 1):
            value = scale * (0.1 + 0.9 * j / count)
            levels.append(value)
            if signed:
                levels.append(-value)
    return tuple(sorted(levels))


def dynamic_map(signed: bool, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The sorted fp32 code book: 255 entries (signed) or 256 (unsigned), all in [-1, 1]."""
    return torch.tensor(_dynamic_map_values(signed), dtype=torch.float32, device=device)


_MAP_CACHE: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
_LUT_CACHE: dict[tuple[bool, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}

# [Note: nearest code without a binary search]
# ``searchsorted`` over 255 midpoints costs ~60 ns per element on CPU, more than the rest of the
# optimizer step. Instead, the top 9 + 10 bits of |x| (exponent and 10 mantissa bits) index a
# table giving ``base = #{midpoints < bucket start}``. A bucket spans a relative width of 2^-10,
# less than the smallest relative gap between midpoints (0.9/64 at 1), so it holds at most one
# midpoint, ``mid[base]``, and ``#{mid < x} = base + (mid[base] < x)``: exactly what
# ``searchsorted(mid, x)`` returns, at a few elementwise passes. Negative x use the map's
# symmetry: ``#{mid < -a} = len(mid) - #{mid <= a}``.
_MANTISSA_SHIFT = 23 - 10
_LUT_SIZE = (0x3F800000 >> _MANTISSA_SHIFT) + 2  # buckets up to and including 1.0


def _map_and_midpoints(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    key = (signed, device)
    cached = _MAP_CACHE.get(key)
    if cached is None:
        code = dynamic_map(signed, device=device)
        mid = (code[:-1] + code[1:]) * 0.5
        cached = (code, mid)
        _MAP_CACHE[key] = cached
    return cached


def _bucket_base(signed: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(base per bucket (int32), midpoints padded with +inf)."""
    key = (signed, device)
    cached = _LUT_CACHE.get(key)
    if cached is None:
        _, mid = _map_and_midpoints(signed, device)
        starts = torch.arange(_LUT_SIZE, dtype=torch.int32, device=device) << _MANTISSA_SHIFT
        lut = torch.searchsorted(mid, starts.view(torch.float32), out_int32=True)
        padded = torch.cat([mid, mid.new_full((1,), float("inf"))])
        cached = (lut, padded)
        _LUT_CACHE[key] = cached
    return cached


def nearest_code(normed: torch.Tensor, signed: bool) -> torch.Tensor:
    """Index of the nearest map entry for each value in [-1, 1] (= ``searchsorted(mid, x)``)."""
    code, mid = _map_and_midpoints(signed, normed.device)
    base_lut, padded = _bucket_base(signed, normed.device)
    a = normed.abs()
    bucket = (a.view(torch.int32) >> _MANTISSA_SHIFT).clamp_(max=_LUT_SIZE - 1)
    base = base_lut.index_select(0, bucket)
    nxt = padded.index_select(0, base)
    below = base + (nxt < a)
    if not signed:
        return below.clamp_(max=code.numel() - 1)
    at_or_below = base + (nxt <= a)
    idx = torch.where(normed < 0, mid.numel() - at_or_below, below)
    # NaN (a poisoned block) lands anywhere valid: its absmax is NaN, so it dequantizes to NaN.
    return idx.clamp_(0, code.numel() - 1)


def _blocks(x: torch.Tensor, block_size: int, head: int) -> torch.Tensor:
    """View (copying only when padding is needed) ``x`` as ``(nblocks, block_size)``.

    ``head`` is the offset of ``x[0]`` inside its first block (its global flat index modulo the
    block size): a shard that starts mid-block gets ``head`` leading zeros. Zeros never change an
    absmax, and the padded slots are dropped again on the way back.
    """
    n = x.numel()
    tail = (-(head + n)) % block_size
    if head == 0 and tail == 0:
        return x.view(-1, block_size)
    padded = torch.zeros(head + n + tail, dtype=x.dtype, device=x.device)
    padded[head : head + n] = x
    return padded.view(-1, block_size)


def block_absmax(x: torch.Tensor, block_size: int, head: int = 0) -> torch.Tensor:
    """Max of ``|x|`` over each block (blocks relative to the global flat index; fp32).

    NaN anywhere in a block makes its absmax NaN; an Inf makes it Inf.
    """
    if x.numel() == 0:
        return torch.zeros(0, dtype=torch.float32, device=x.device)
    blocks = _blocks(x.float(), block_size, head)
    return blocks.abs().amax(dim=1)


def quantize_blockwise(
    x: torch.Tensor, absmax: torch.Tensor, block_size: int, *, signed: bool, head: int = 0
) -> torch.Tensor:
    """Codes (uint8, same numel as ``x``) of the fp32 flat tensor ``x`` given each block's absmax.

    ``absmax`` has one entry per block touched by ``x`` (see ``block_absmax``); it is taken as
    given so that a caller can substitute the absmax of a whole block when ``x`` holds only part
    of it. A zero block (absmax 0) quantizes to code of 0.0.

    [Note: a positive second moment never becomes zero]
    With ``signed=False`` (Adam's v) a strictly positive value that would round to the 0.0 code
    is given the smallest positive code instead. Otherwise an element whose v is tiny next to its
    block's largest v stores v = 0 while its m (signed map, relative to m's own absmax) does not,
    and the update m / (sqrt(v) + eps) explodes to ~m / eps once its gradient vanishes (seen in
    the optimizer benchmark: an embedding row moved by 17.8 at lr 3e-3; torchao has the same
    failure, bitsandbytes does not). Rounding v up only ever makes that update smaller.
    """
    n = x.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=x.device)
    blocks = _blocks(x.float(), block_size, head)
    scale = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normed = blocks / scale.unsqueeze(1)
    flat = normed.reshape(-1)
    idx = nearest_code(flat, signed)
    if not signed:
        idx = torch.where((idx == 0) & (flat > 0), torch.ones_like(idx), idx)
    return idx.view(-1)[head : head + n].to(torch.uint8)


def dequantize_blockwise(
    codes: torch.Tensor, absmax: torch.Tensor, block_size: int, *, signed: bool, head: int = 0
) -> torch.Tensor:
    """fp32 values ``map[codes] * absmax`` of the flat uint8 ``codes`` (inverse of quantize)."""
    n = codes.numel()
    code, _ = _map_and_midpoints(signed, codes.device)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32, device=codes.device)
    values = code.index_select(0, codes.int())
    blocks = _blocks(values, block_size, head)
    return (blocks * absmax.unsqueeze(1)).view(-1)[head : head + n]


# -- in-place chunk kernels (AdamW8bit's bounded-memory step) --------------------------------
#
# [Note: chunks with bounded scratch]
# The step works through a run of parameters in chunks of whole quantization blocks, reusing
# one set of scratch buffers for every chunk, so its transient memory is a constant number of
# bytes per *chunk* element instead of ~40 bytes per parameter element. A chunk is laid out in
# a "padded" fp32 view of ``nb * block`` elements: the real elements at ``[head, head + n)`` and
# zeros around them (a shard that starts or ends inside a block), exactly the layout ``_blocks``
# builds by copying, so absmaxes and codes are those of the one-shot functions above.


class Scratch:
    """Reusable buffers of ``capacity`` elements: four fp32, two int32, one bool."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.f = [torch.empty(capacity, dtype=torch.float32, device=device) for _ in range(4)]
        self.i = [torch.empty(capacity, dtype=torch.int32, device=device) for _ in range(2)]
        self.b = torch.empty(capacity, dtype=torch.bool, device=device)


def dequantize_into(
    out: torch.Tensor,
    codes: torch.Tensor,
    absmax: torch.Tensor,
    block_size: int,
    head: int,
    signed: bool,
    index: torch.Tensor,
) -> torch.Tensor:
    """Fill the padded view ``out`` (``len(absmax) * block_size`` fp32) with ``map[codes] *
    absmax`` at ``[head, head + n)`` and zeros elsewhere; returns the real part. ``index`` is
    int32 scratch of at least ``n`` elements."""
    n = codes.numel()
    code, _ = _map_and_midpoints(signed, codes.device)
    real = out[head : head + n]
    idx = index[:n]
    idx.copy_(codes)
    torch.index_select(code, 0, idx, out=real)
    out.view(-1, block_size).mul_(absmax.unsqueeze(1))
    _zero_pads(out, head, n)
    return real


def _zero_pads(out: torch.Tensor, head: int, n: int) -> None:
    if head:
        out[:head].zero_()
    if head + n < out.numel():
        out[head + n :].zero_()


def absmax_into(
    out: torch.Tensor,
    padded: torch.Tensor,
    block_size: int,
    head: int,
    n: int,
    nonnegative: bool,
    tmp: torch.Tensor,
) -> None:
    """``out[b] = max |padded block b|`` (padding zeroed first); ``tmp`` is fp32 scratch of the
    padded size, unused when the values are known to be ``>= 0`` (Adam's v)."""
    _zero_pads(padded, head, n)
    source = padded
    if not nonnegative:
        source = tmp[: padded.numel()]
        torch.abs(padded, out=source)
    torch.amax(source.view(-1, block_size), dim=1, out=out)


def quantize_into(
    codes: torch.Tensor,
    padded: torch.Tensor,
    absmax: torch.Tensor,
    block_size: int,
    head: int,
    signed: bool,
    scratch: Scratch,
    a_buf: torch.Tensor,
    nxt_buf: torch.Tensor,
) -> None:
    """``codes`` (uint8, in place) of the real part of ``padded`` given each block's absmax;
    same result as ``quantize_blockwise``. ``padded`` is normalized in place (clobbered);
    ``a_buf`` and ``nxt_buf`` are two more fp32 scratch buffers (not ``padded``); the int32 and
    bool buffers of ``scratch`` are used too."""
    n = codes.numel()
    if n == 0:
        return
    scale = torch.where(absmax > 0, absmax, 1.0)
    blocks = padded.view(-1, block_size)
    blocks.div_(scale.unsqueeze(1))
    normed = padded[head : head + n]
    code, mid = _map_and_midpoints(signed, codes.device)
    base_lut, padded_mid = _bucket_base(signed, codes.device)
    a = a_buf[:n]
    torch.abs(normed, out=a)
    bucket, base = scratch.i[0][:n], scratch.i[1][:n]
    torch.bitwise_right_shift(a.view(torch.int32), _MANTISSA_SHIFT, out=bucket)
    bucket.clamp_(max=_LUT_SIZE - 1)
    torch.index_select(base_lut, 0, bucket, out=base)
    nxt = nxt_buf[:n]
    torch.index_select(padded_mid, 0, base, out=nxt)
    flag = scratch.b[:n]
    # [Note: comparisons without temporaries] int32 + bool allocates a promoted copy of the
    # bool operand, so every comparison goes bool -> copy into the free int32 buffer -> int op.
    count = bucket  # the bucket index is consumed: its buffer holds 0/1 counts from here on
    torch.lt(nxt, a, out=flag)
    count.copy_(flag)
    base.add_(count)  # = #{mid < |x|}
    if not signed:
        base.clamp_(max=code.numel() - 1)
        # a positive v never becomes the 0 code (see quantize_blockwise's note): a code of 0
        # with normed > 0 becomes 1, max(code, normed > 0), every other code is >= 1 already
        torch.gt(normed, 0, out=flag)
        count.copy_(flag)
        torch.maximum(base, count, out=base)
        codes.copy_(base)
        return
    # negative x: #{mid < -|x|} = len(mid) - #{mid <= |x|} = len(mid) - below - [mid == |x|]
    torch.eq(nxt, a, out=flag)
    count.copy_(flag)
    count.add_(base).neg_().add_(mid.numel())
    torch.lt(normed, 0, out=flag)
    torch.where(flag, count, base, out=base)
    base.clamp_(0, code.numel() - 1)
    codes.copy_(base)
