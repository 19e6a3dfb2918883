"""The packed (byte) all-gather: per-rank segments of several dtypes in one collective.

Numerics: bytes are moved and reinterpreted, never computed (compared bitwise).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from dbuffer_helpers import (
    collective_counts,
    install_collective_counter,
    reset_collective_counts,
)
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import (
    DBuffer,
    LayoutMismatchError,
    PackedAllGather,
    contiguous_layout,
    packed_layout,
)
from dbuffer.testing import load_full_
from ragged_dtensor.testing import run_processes, run_threaded

install_collective_counter()  # counts the threaded group's calls too (no dispatcher there)
SHAPES = [(6, 5), (7,), (3, 4)]


def test_layout_offsets_are_aligned_and_sections_equal() -> None:
    layout = packed_layout([[5, 3, 8], [0, 17], [1]], align=16)
    assert layout.offsets == ((0, 16, 32), (0, 0), (0,))
    assert layout.section_bytes == 48  # rank 0 ends at 40, rounded up
    assert layout.world_size == 3
    assert packed_layout([[0], [0]]).section_bytes == 16  # never a zero-byte collective
    assert packed_layout([[3]], align=1).section_bytes == 3
    assert layout.fingerprint == packed_layout([[5, 3, 8], [0, 17], [1]]).fingerprint
    assert layout.fingerprint != packed_layout([[5, 3, 8], [0, 17], [2]]).fingerprint


def test_segments_view_any_dtype() -> None:
    layout = packed_layout([[3, 8, 2], [4, 4]])
    data = torch.arange(2 * layout.section_bytes, dtype=torch.uint8)
    seg = layout.segment(data, 1, 1, torch.float32)
    assert seg.numel() == 1 and seg.untyped_storage().data_ptr() == data.data_ptr()
    assert layout.segment(data, 0, 1, torch.bfloat16).numel() == 4
    assert torch.equal(layout.segment(data, 0, 0, torch.uint8), torch.tensor([0, 1, 2]).byte())
    send = layout.segment(data[: layout.section_bytes], 0, 2, torch.uint8, gathered=False)
    assert torch.equal(send, torch.tensor([32, 33]).byte())


@pytest.mark.parametrize(
    ("sizes", "align", "match"),
    [
        ([], 16, "one entry per rank"),
        ([[3, -1]], 16, "rank 0's segment 1 has -1 bytes"),
        ([[3]], 0, "align must be >= 1"),
    ],
)
def test_bad_layouts_are_named(sizes: list[list[int]], align: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        packed_layout(sizes, align=align)


def test_a_segment_that_is_not_whole_elements_is_refused() -> None:
    layout = packed_layout([[6]])
    with pytest.raises(ValueError, match="segment 0 has 6 bytes, not a whole number of"):
        layout.segment(torch.zeros(16, dtype=torch.uint8), 0, 0, torch.float32)


def _sizes(buf: DBuffer) -> list[list[int]]:
    """Rank k sends: its shard as bf16 bytes, then k + 1 fp32 "scales" (sizes differ by rank)."""
    return [[2 * buf.shard_size, 4 * (k + 1)] for k in range(buf.world_size)]


def _packed_roundtrip(rank: int, world: int) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (world,))
    numels = [torch.Size(s).numel() for s in SHAPES]
    buf = DBuffer(contiguous_layout(numels, world), SHAPES, mesh)
    gen = torch.Generator().manual_seed(3)
    full = [torch.randn(s, generator=gen) for s in SHAPES]
    load_full_(buf, full)
    layout = packed_layout(_sizes(buf))
    gather = PackedAllGather(buf, layout)
    extra: list[torch.Tensor] = []

    def encode(send: torch.Tensor) -> None:
        layout.segment(send, rank, 0, torch.bfloat16, gathered=False).copy_(buf.shard)
        layout.segment(send, rank, 1, torch.float32, gathered=False).fill_(rank + 0.5)

    def decode(recv: torch.Tensor, out: torch.Tensor) -> None:
        for k in range(world):
            part = out[k * buf.shard_size : (k + 1) * buf.shard_size]
            part.copy_(layout.segment(recv, k, 0, torch.bfloat16))
            extra.append(layout.segment(recv, k, 1, torch.float32).clone())

    views = buf.full_views(torch.bfloat16, allow_released=True)
    versions = [v._version for v in views]
    reset_collective_counts()
    handle = gather.unshard(encode, decode, dtype=torch.bfloat16, async_op=True)
    handle.wait()
    # one collective; none on one rank (the section is decoded where it was encoded)
    assert collective_counts() == Counter({"all_gather_single": 1} if world > 1 else {})
    for view, tensor in zip(buf.full_views(torch.bfloat16), full, strict=True):
        assert torch.equal(view, tensor.to(torch.bfloat16))
    assert [v._version for v in views] == versions  # saved-for-backward views stay valid
    for k, values in enumerate(extra):
        assert torch.equal(values, torch.full((k + 1,), k + 0.5))
    buf.reshard()
    assert not buf.is_unsharded(torch.bfloat16)
    return {"section": layout.section_bytes}


@pytest.mark.parametrize("world", [1, 2, 3])
def test_packed_all_gather_threaded(world: int) -> None:
    results = run_threaded(_packed_roundtrip, world)
    assert len({r["section"] for r in results}) == 1


@pytest.mark.slow  # CI: fsdp-engine's quantized gloo tests run this path at ws 2, 3 and 4
@pytest.mark.multiprocess
def test_packed_all_gather_gloo() -> None:
    """Async on real gloo processes: bytes of several dtypes, one collective."""
    run_processes(_packed_roundtrip, 3, timeout=120)


def _disagree(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    buf = DBuffer(contiguous_layout([8], world), [(8,)], mesh)
    sizes = [[16 + (rank == 1) * 16] for _ in range(world)]  # rank 1 believes in other sizes
    try:
        PackedAllGather(buf, packed_layout(sizes))
    except LayoutMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_that_disagree_on_the_layout_raise_on_every_rank() -> None:
    messages = run_threaded(_disagree, 3, timeout=30)
    for message in messages:
        assert "packed all-gather" in message and "section bytes" in message


def test_the_layout_must_match_the_shard_axis() -> None:
    def body(rank: int, world: int) -> str:
        mesh = init_device_mesh("cpu", (world,))
        buf = DBuffer(contiguous_layout([8], world), [(8,)], mesh)
        try:
            PackedAllGather(buf, packed_layout([[4]] * (world + 1)))
        except ValueError as exc:
            return str(exc)
        return "no error"

    for message in run_threaded(body, 2):
        assert "sections for 3 ranks" in message and "has 2" in message
