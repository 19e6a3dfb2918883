"""One rank's share of a random fill, with the values one device draws, without the full tensor.

[Note: a sequential stream, drawn chunk by chunk]
On CPU the generator (mt19937) is a sequential stream: ``uniform_`` takes one number per
element in row-major order (``cpu_serial_kernel``), so drawing a tensor's elements in
consecutive pieces takes the same numbers as drawing it at once. ``normal_`` of 16 or more
contiguous elements fills the tensor with uniforms, turns each group of 16 into normals, and,
when 16 does not divide the size, draws 16 more uniforms for the last 16 elements
(``normal_fill`` in ATen's cpu/DistributionTemplates.h). Pieces whose sizes are multiples of 16,
but for a last piece of at least 16, reproduce that exactly: the groups of 16 fall at the same
elements and the tail is redrawn from the same point of the stream. So a rank draws the whole
stream through one buffer of at most ``CHUNK_BYTES`` (reused) and keeps the part that falls in
its range: memory is its share plus one chunk, time is one full draw (as before: a sequential
stream cannot skip ahead, and every rank must leave the generator where one device leaves it).

[Note: a counter-based stream, drawn at an offset]
CUDA's generator is Philox, counter-based: ``uniform_`` and ``normal_`` run a grid-stride kernel
(``distribution_elementwise_grid_stride_kernel`` in ATen's cuda/DistributionTemplates.h) with
``T = 256 * G`` threads, ``G = min(SMs * (max threads per SM // 256), ceil(n / 256))`` blocks,
and ``u`` values per Philox call (4 for float, half and bfloat16; 2 for double). Element ``i``
is value ``(i // T) % u`` of call ``i // (T * u)`` of thread ``i % T``, at Philox offset
``offset + 4 * (i // (T * u))`` of subsequence ``i % T``; the generator's offset then moves on
by ``4 * ceil(n / (T * u))``. Once ``n >= 256 * (G_max - 1) + 1`` the grid is ``G_max`` whatever
``n`` is, so a draw of ``count`` elements (a multiple of the period ``P = T * u``) starting at
offset ``offset + 4 * (first / P)`` produces exactly elements ``first .. first + count`` of the
full draw. A rank therefore draws only the periods that overlap its range (its share plus at
most two periods: 4 MiB of fp32 on an H100) and sets the offset to where the full draw leaves
it. Smaller tensors are drawn whole (at most ``256 * G_max`` elements); tensors needing 64-bit
indexing (``n * itemsize >= 2**31``, where the kernel is split into several launches), and
generators that are neither CPU nor CUDA, use the caller's fallback (the whole tensor).
``philox_window`` is that arithmetic, kept free of CUDA so it is tested on any machine.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

__all__ = [
    "CHUNK_BYTES",
    "STREAM_OPS",
    "PhiloxWindow",
    "chunk_bounds",
    "draw_at_offset",
    "draw_share",
    "philox_unroll",
    "philox_window",
]

aten = torch.ops.aten

# The reusable buffer of a sequential draw (module Note): 4 MiB, 1 Mi fp32 elements. Measured
# (benchmarks/bench_random_init.py, 1 GiB of Linear layers at 4 ranks): peak growth over the
# shards +18 MiB with 4 MiB buffers, +66 MiB with 16 MiB ones (freed buffers the allocator
# keeps resident, most likely); 256 pieces per GiB cost nothing measurable.
CHUNK_BYTES = 4 << 20
# Ops whose element order and stream use the Notes describe (nn.init's uniform_ / normal_,
# hence kaiming_*, xavier_*, trunc_normal_, ...).
STREAM_OPS = frozenset({aten.uniform_.default, aten.normal_.default})
_GROUP = 16  # normal_fill's group of elements
_BLOCK = 256  # block_size_bound of ATen's CUDA distribution kernels
_OFFSETS_PER_CALL = 4  # max_generator_offsets_per_curand_call
_INT32_MAX = (1 << 31) - 1


def chunk_bounds(numel: int, chunk: int) -> list[tuple[int, int]]:
    """Pieces ``[a, b)`` covering ``[0, numel)``: sizes multiples of 16 (``chunk`` rounded down
    to one, at least 32), but for the last, which is at least 16 when ``numel`` is (module Note:
    a sequential stream, drawn chunk by chunk). None is longer than ``chunk`` (or 32)."""
    step = max(2 * _GROUP, chunk // _GROUP * _GROUP)
    if numel <= step:
        return [(0, numel)] if numel else []
    cuts = [*range(0, numel, step), numel]
    if numel - cuts[-2] < _GROUP:
        cuts[-2] -= _GROUP  # the previous piece stays a multiple of 16, the last >= 16
    return list(itertools.pairwise(cuts))


def philox_unroll(dtype: torch.dtype) -> int:
    """Values per Philox call of ATen's CUDA uniform_ / normal_ for ``dtype``: ``float4`` over
    the accumulation type (``double2`` for double)."""
    return 2 if dtype == torch.float64 else 4


@attrs.frozen
class PhiloxWindow:
    """What a rank draws for elements ``[start, stop)`` of a fill of ``numel`` (module Note): a
    draw of ``count`` elements at the generator's offset plus ``skip``, whose elements
    ``start - first .. stop - first`` are the rank's; then the offset is set to the original
    plus ``advance``, where the full draw leaves it."""

    first: int
    count: int
    skip: int
    advance: int


def philox_window(
    numel: int, start: int, stop: int, unroll: int, max_blocks: int
) -> PhiloxWindow | None:
    """The draw of elements ``[start, stop)`` of a full fill of ``numel`` elements on a device
    whose distribution kernels launch at most ``max_blocks`` blocks of 256 threads, ``unroll``
    values per Philox call; ``None`` when the full draw's grid depends on ``numel`` (small
    tensors: draw them whole)."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"range [{start}, {stop}) is not inside a tensor of {numel} elements")
    if numel <= _BLOCK * (max_blocks - 1):
        return None  # the grid is ceil(numel / 256) blocks: not the one a window would get
    period = _BLOCK * max_blocks * unroll
    advance = _OFFSETS_PER_CALL * ((numel - 1) // period + 1)
    if start == stop:
        return PhiloxWindow(first=0, count=0, skip=0, advance=advance)
    first = start // period * period
    count = -(-stop // period) * period - first
    skip = _OFFSETS_PER_CALL * (first // period)
    return PhiloxWindow(first=first, count=count, skip=skip, advance=advance)


def _draw_sequential(
    op_call: torch._ops.OpOverload,
    rest: Sequence[object],
    kwargs: dict[str, object],
    local: torch.Tensor,
    numel: int,
    start: int,
) -> None:
    stop = start + local.numel()
    chunk = max(1, CHUNK_BYTES // local.element_size())
    pieces = chunk_bounds(numel, chunk)
    longest = max((b - a for a, b in pieces), default=0)
    buffer = torch.empty(longest, dtype=local.dtype, device=local.device)
    for a, b in pieces:
        piece = buffer[: b - a]
        op_call(piece, *rest, **kwargs)
        lo, hi = max(a, start), min(b, stop)
        if lo < hi:
            local[lo - start : hi - start].copy_(piece[lo - a : hi - a])


def _cuda_generator(kwargs: dict[str, object]) -> torch.Generator:
    """The generator the op draws from: the one passed, else the default generator of the
    *current* CUDA device (ATen's ``getDefaultCUDAGenerator()`` with no index), which is what
    one device's draw uses too."""
    gen = kwargs.get("generator")
    if isinstance(gen, torch.Generator):
        return gen
    default: torch.Generator = torch.cuda.default_generators[torch.cuda.current_device()]
    return default


def draw_at_offset(
    op_call: Callable[..., object],
    rest: Sequence[object],
    kwargs: dict[str, object],
    local: torch.Tensor,
    numel: int,
    start: int,
    gen: Any,
    max_blocks: int,
) -> bool:
    """The counter-based path (module Note): ``gen`` has ``get_offset`` / ``set_offset`` (the
    generator ``op_call`` draws from), ``max_blocks`` the device's resident blocks of 256
    threads. False (nothing drawn, nothing moved) when the tensor must be drawn whole."""
    if numel * local.element_size() > _INT32_MAX:
        return False  # the full draw is split into several launches
    window = philox_window(
        numel, start, start + local.numel(), philox_unroll(local.dtype), max_blocks
    )
    if window is None:
        return False
    base = gen.get_offset()
    if window.count:
        gen.set_offset(base + window.skip)
        drawn = torch.empty(window.count, dtype=local.dtype, device=local.device)
        op_call(drawn, *rest, **kwargs)
        lead = start - window.first
        local.copy_(drawn[lead : lead + local.numel()])
    gen.set_offset(base + window.advance)
    return True


def draw_share(
    op_call: torch._ops.OpOverload,
    rest: Sequence[object],
    kwargs: dict[str, object],
    local: torch.Tensor,
    numel: int,
    start: int,
) -> bool:
    """Fill ``local`` (flat, contiguous) with elements ``start .. start + local.numel()`` of
    what ``op_call`` draws for a contiguous tensor of ``numel`` elements, consuming the
    generator as that draw does; the path chosen by the generator's device (module Notes).
    False when no path applies (the caller draws the whole tensor)."""
    if op_call not in STREAM_OPS or not local.is_contiguous() or local.dim() != 1:
        return False
    device = local.device
    if device.type == "cpu":
        with torch.no_grad():
            _draw_sequential(op_call, rest, kwargs, local, numel, start)
        return True
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        blocks = props.multi_processor_count * (props.max_threads_per_multi_processor // _BLOCK)
        gen = _cuda_generator(kwargs)
        with torch.no_grad():
            return draw_at_offset(op_call, rest, kwargs, local, numel, start, gen, blocks)
    return False
