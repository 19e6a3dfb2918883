"""A random fill of a ragged share draws only the share (plus one bounded chunk) and gets the
values, and leaves the generator in the state, that one device's fill of the whole tensor does.

Numeric kind: *same arithmetic* (the same generator draws), compared bitwise. The sequential
(CPU) path is run for real; the counter-based (CUDA Philox) path's arithmetic is checked against
a simulation of ATen's grid-stride kernel (which element is which value of which Philox call of
which thread), and its use of the generator with a fake counter-based generator, on CPU.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import init_device_mesh

from ragged_dtensor import RaggedShard, distribute_tensor
from ragged_dtensor._private import compat as ragged_compat
from ragged_dtensor._private import random_stream as rs
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

aten = torch.ops.aten
DRAWS = {
    "uniform_": (aten.uniform_.default, (-2.0, 3.0)),
    "normal_": (aten.normal_.default, (1.0, 0.5)),
}


@pytest.mark.parametrize("numel", [0, 1, 15, 16, 17, 31, 32, 33, 47, 100, 257, 1000])
@pytest.mark.parametrize("chunk", [1, 32, 48, 64, 100])
def test_chunks_cover_in_groups_of_16(numel: int, chunk: int) -> None:
    pieces = rs.chunk_bounds(numel, chunk)
    if numel == 0:
        assert pieces == []
        return
    assert [a for a, _ in pieces] == [0, *(b for _, b in pieces[:-1])]
    assert (pieces[-1][1] if pieces else 0) == numel
    for a, b in pieces[:-1]:
        assert (b - a) % 16 == 0 and b > a
    if pieces and numel >= 16:
        assert pieces[-1][1] - pieces[-1][0] >= 16
    assert all(b - a <= max(32, chunk) for a, b in pieces)


@pytest.mark.parametrize("op", list(DRAWS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("numel", [1, 15, 16, 17, 40, 100, 257, 1000])
def test_sequential_share_equals_the_whole_draw(
    op: str, dtype: torch.dtype, numel: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every range of every size, chunks of 32 to 100 elements: the share is the whole draw's
    slice, and the generator ends where the whole draw leaves it."""
    op_call, args = DRAWS[op]
    whole_gen = torch.Generator().manual_seed(7)
    whole = torch.empty(numel, dtype=dtype)
    op_call(whole, *args, generator=whole_gen)
    after = torch.rand(3, generator=whole_gen)
    itemsize = whole.element_size()
    for chunk in (32, 48, 100):
        monkeypatch.setattr(rs, "CHUNK_BYTES", chunk * itemsize)
        for start, stop in [(0, numel), (0, 0), (numel // 3, numel - numel // 4), (numel, numel)]:
            gen = torch.Generator().manual_seed(7)
            local = torch.full((stop - start,), -9.0, dtype=dtype)
            assert rs.draw_share(op_call, args, {"generator": gen}, local, numel, start)
            assert torch.equal(local, whole[start:stop]), (chunk, start, stop)
            assert torch.equal(torch.rand(3, generator=gen), after)


def _kernel_map(numel: int, unroll: int, max_blocks: int) -> list[tuple[int, int, int]]:
    """ATen's distribution_elementwise_grid_stride_kernel, simulated: for each element, (Philox
    subsequence = thread, offset of its call relative to the launch's, value index in the call),
    and the launch's offset increment as the last entry (calc_execution_policy)."""
    block = 256
    grid = min(max_blocks, -(-numel // block))
    threads = block * grid
    rounded = ((numel - 1) // (threads * unroll) + 1) * threads * unroll
    out: list[tuple[int, int, int]] = [(-1, -1, -1)] * numel
    for idx in range(threads):
        for call, linear in enumerate(range(idx, rounded, threads * unroll)):
            for ii in range(unroll):
                li = linear + threads * ii
                if li < numel:
                    out[li] = (idx, 4 * call, ii)
    increment = ((numel - 1) // (threads * unroll) + 1) * 4
    return [*out, (increment, increment, increment)]


@pytest.mark.parametrize("max_blocks", [1, 2, 3])
@pytest.mark.parametrize("unroll", [2, 4])
def test_philox_window_draws_the_same_counters(max_blocks: int, unroll: int) -> None:
    """The window's draw (at the shifted offset, ``count`` elements) gives every element of the
    rank's range the (thread, offset, value) the whole launch gives it, and the generator's
    offset moves by what the whole launch moves it; small tensors are drawn whole."""
    threads = 256 * max_blocks
    small = 256 * (max_blocks - 1)  # the largest size whose launch has fewer blocks
    for numel in sorted({max(1, small), small + 1, 3 * threads * unroll + 5}):
        full = _kernel_map(numel, unroll, max_blocks)
        cuts = sorted({0, 1, numel // 5, numel // 2, max(0, numel - 7), numel - 1, numel})
        for start, stop in itertools.combinations_with_replacement(cuts, 2):
            window = rs.philox_window(numel, start, stop, unroll, max_blocks)
            if numel <= 256 * (max_blocks - 1):
                assert window is None
                continue
            assert window is not None
            assert window.advance == full[-1][0]
            if start == stop:
                continue
            assert window.count % (threads * unroll) == 0
            assert window.count <= stop - start + 2 * threads * unroll
            part = _kernel_map(window.count, unroll, max_blocks)
            for li in range(start, stop):
                idx, off, ii = part[li - window.first]
                assert (idx, window.skip + off, ii) == full[li], (numel, start, stop, li)


class _FakePhilox:
    """A counter-based generator and its fill, built on ``_kernel_map``: element ``li`` of a
    launch gets a value that depends only on (subsequence, offset, value index)."""

    def __init__(self, max_blocks: int) -> None:
        self.offset = 0
        self.max_blocks = max_blocks

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        assert offset % 4 == 0
        self.offset = offset

    def fill(self, out: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        mapping = _kernel_map(out.numel(), 4, self.max_blocks)
        values = [
            float((idx * 7919 + (self.offset + off) * 104729 + ii * 13) % 1000003)
            for idx, off, ii in mapping[:-1]
        ]
        out.copy_(torch.tensor(values, dtype=out.dtype))
        self.offset += mapping[-1][0]
        return out


def test_counter_based_path_reads_only_its_window() -> None:
    """``draw_at_offset`` with a fake counter-based generator: every rank's share equals the
    whole launch's, the draw holds at most the share plus two periods, and the generator's
    offset ends where the whole launch leaves it."""
    numel, blocks = 256 * 2 * 4 * 3 + 11, 2
    whole_gen = _FakePhilox(blocks)
    whole_gen.offset = 40
    whole = whole_gen.fill(torch.empty(numel, dtype=torch.float64))
    cuts = [0, 700, 2048, 3000, numel]
    for start, stop in itertools.pairwise(cuts):
        gen = _FakePhilox(blocks)
        gen.offset = 40
        sizes: list[int] = []

        def fill(
            out: torch.Tensor, *a: Any, _g: _FakePhilox = gen, _s: list[int] = sizes, **k: Any
        ) -> torch.Tensor:
            _s.append(out.numel())
            return _g.fill(out)

        local = torch.empty(stop - start, dtype=torch.float32)
        assert rs.draw_at_offset(fill, (), {}, local, numel, start, gen, blocks)
        assert torch.equal(local, whole[start:stop].float())
        assert gen.offset == whole_gen.offset
        assert sizes and max(sizes) <= stop - start + 2 * 256 * blocks * 4


def _dtensor_body(rank: int, world: int, placement: RaggedShard) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    shape = (37, 53)  # 1961 elements: many 16-element groups and a ragged tail
    problems = []
    fills = {
        "uniform_": lambda t, g: t.uniform_(-1, 1, generator=g),
        "normal_": lambda t, g: t.normal_(0.0, 2.0, generator=g),
        "kaiming_uniform_": lambda t, g: nn.init.kaiming_uniform_(t, a=5**0.5, generator=g),
        "trunc_normal_": lambda t, g: nn.init.trunc_normal_(t, std=0.02, generator=g),
        "xavier_normal_": lambda t, g: nn.init.xavier_normal_(t, generator=g),
    }
    for name, fill in fills.items():
        d = distribute_tensor(torch.zeros(shape), mesh, [placement])
        gen = torch.Generator().manual_seed(3)
        fill(d, gen)
        want_gen = torch.Generator().manual_seed(3)
        want = torch.zeros(shape)
        fill(want, want_gen)
        if not torch.equal(d.full_tensor(), want):
            problems.append(name)
        if not torch.equal(torch.rand(4, generator=gen), torch.rand(4, generator=want_gen)):
            problems.append(name + " generator state")
    return problems


@pytest.mark.parametrize(
    "placement",
    [RaggedShard((0,), (20, 17)), RaggedShard((0, 1), (0, 1961)), RaggedShard((), (1, 0))],
    ids=["rows", "rank 0 empty", "rank 1 empty"],
)
def test_ragged_fills_draw_the_share_in_chunks(
    placement: RaggedShard, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nn.init fills on ragged DTensors with 200-byte chunks: one device's values and generator
    state, and never the full-tensor path (the share cut from a full temporary)."""
    monkeypatch.setattr(rs, "CHUNK_BYTES", 200)

    def no_full(*args: object) -> torch.Tensor:
        raise AssertionError("the full-tensor path ran")

    monkeypatch.setattr(ragged_compat, "_cut_share", no_full)
    for problems in run_threaded(_dtensor_body, 2, placement):
        assert not problems, problems


def test_other_devices_fall_back() -> None:
    """A device with neither path (meta here) is left to the caller's full draw."""
    assert not rs.draw_share(aten.uniform_.default, (), {}, torch.empty(8, device="meta"), 16, 0)
    # bernoulli_ is not a stream op (its CPU kernel may seed a parallel MKL stream)
    assert not rs.draw_share(aten.bernoulli_.float, (0.5,), {}, torch.empty(4), 8, 0)
