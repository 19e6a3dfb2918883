"""Host cost that does not grow with the world size, and storage reused in place.

- the per-tensor geometry (units per rank, first cut, layout checks) is computed without a
  Python step per rank, and equals the per-rank definition;
- building a buffer, ``new_like`` and every per-step operation run the same Python lines at
  m = 64 and m = 16384 (fake process group: rank 0 of m, collectives move nothing);
- ``release_shard`` frees the shard storage in place only while nobody outside holds it or one of
  its views, and the same views see the re-allocated memory.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor

from dbuffer import DBuffer, contiguous_layout
from dbuffer._private import refs
from dbuffer._private.layout import _units_match, first_cut, span_units
from dbuffer.testing import sharded_views, views_held_elsewhere
from ragged_dtensor.testing import run_threaded

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
DBUFFER_SRC = str(Path(__import__("dbuffer").__file__).parent)


def _brute_units(start: int, numel: int, block: int, size: int, world: int) -> tuple[int, ...]:
    return tuple(
        max(0, min(start + numel, (k + 1) * size) - max(start, k * size)) // block
        for k in range(world)
    )


def _brute_cut(start: int, numel: int, block: int, size: int) -> int | None:
    for b in range((start // size + 1) * size, start + numel, size):
        if (b - start) % block:
            return b
    return None


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.integers(1, 12),
    st.integers(1, 30),
    st.integers(1, 40),
    st.integers(0, 60),
)
def test_property_geometry_equals_the_per_rank_definition(
    block: int, blocks: int, size: int, start: int
) -> None:
    numel = block * blocks
    world = (start + numel) // size + 2
    assert first_cut(start, numel, block, size) == _brute_cut(start, numel, block, size)
    if first_cut(start, numel, block, size) is not None:
        return
    units = span_units(start, numel, block, size, world)
    assert units == _brute_units(start, numel, block, size, world)
    assert _units_match(units, block, start, numel, size)
    # any other split of the same total is rejected
    for k in range(world):
        for delta in (-1, 1):
            moved = list(units)
            moved[k] += delta
            moved[(k + 1) % world] -= delta
            if min(moved) >= 0 and tuple(moved) != units:
                assert not _units_match(tuple(moved), block, start, numel, size)


# -- Python work per operation, at two world sizes ------------------------------------------------
SHAPES = [(64,), (64,), (256, 64), (256,), (64, 256), (64,)]


def _lines_in_dbuffer(fn: Callable[[], Any]) -> Counter[tuple[str, int]]:
    """How often each Python line of dbuffer's own source ran during ``fn()``."""
    hits: Counter[tuple[str, int]] = Counter()

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if not frame.f_code.co_filename.startswith(DBUFFER_SRC):
            return None  # do not trace lines of other code
        if event == "line":
            hits[(frame.f_code.co_filename, frame.f_lineno)] += 1
        return tracer

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return hits


def _fake_world_lines(world: int) -> dict[str, Counter[tuple[str, int]]]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        numels = [int(torch.Size(s).numel()) for s in SHAPES]
        layout = contiguous_layout(numels, world, align=4)
        counts: dict[str, Counter[tuple[str, int]]] = {}
        box: dict[str, Any] = {}

        def build() -> None:
            box["params"] = DBuffer(layout, SHAPES, mesh, check=False)

        counts["build"] = _lines_in_dbuffer(build)
        params: DBuffer = box["params"]
        counts["sharded_views"] = _lines_in_dbuffer(lambda: sharded_views(params))

        def like() -> None:
            box["grads"] = params.new_like()
            sharded_views(box["grads"])
            box["grads"].claim_views()

        counts["new_like"] = _lines_in_dbuffer(like)
        grads: DBuffer = box["grads"]

        def step() -> None:
            params.unshard()
            params.full_views()
            params.reshard()
            grads.alloc_shard()
            unsharded = params.new_like()
            unsharded.alloc_unsharded(zero=True)
            unsharded.reduce_scatter(into=grads, op="avg")
            sharded_views(grads)
            assert grads.release_shard()

        step()  # the first call makes the unsharded storage once
        counts["step"] = _lines_in_dbuffer(step)
        return counts
    finally:
        dist.destroy_process_group()


def _in_subprocess(fn: Callable[..., Any], *args: Any) -> Any:
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply_async(fn, args).get(timeout=120)


def test_python_work_does_not_grow_with_world_size() -> None:
    """Lines executed, not times, at m = 64 and m = 16384, for building a buffer (layout checks
    included), its views, ``new_like`` (views and claim) and a step's operations: no line of
    dbuffer runs more than ten times per tensor (a step per rank would run it 16384 times),
    and the totals at the two sizes differ only by branches that depend on where tensors fall
    (at most a few lines per tensor)."""
    small = _in_subprocess(_fake_world_lines, 64)
    large = _in_subprocess(_fake_world_lines, 16384)
    per_tensor = 10 * len(SHAPES)
    for what in small:
        worst = max(large[what].values())
        assert worst <= per_tensor, (what, large[what].most_common(3))
        difference = abs(sum(large[what].values()) - sum(small[what].values()))
        assert difference <= per_tensor * 2, (what, difference)


def test_new_like_shares_the_geometry(monkeypatch: pytest.MonkeyPatch) -> None:
    def body(rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        from dbuffer._private import geometry as geometry_module

        mesh = init_device_mesh("cpu", (world,))
        layout = contiguous_layout([6, 8], world)
        params = DBuffer(layout, [(2, 3), (8,)], mesh)
        views = sharded_views(params)
        original = geometry_module.slots_for
        geometry_module.slots_for = None  # type: ignore[assignment]
        try:
            grads = params.new_like(torch.float64)
        finally:
            geometry_module.slots_for = original
        assert grads.slots is params.slots and grads.geometry is params.geometry
        low = sharded_views(grads)
        for a, b in zip(views, low, strict=True):
            assert a.placements == b.placements and a.shape == b.shape
            assert b.dtype == torch.float64
            assert b.to_local().untyped_storage().data_ptr() == grads.shard.data_ptr()
            # the spec built directly equals what from_local validates and builds
            ref = DTensor.from_local(
                b.to_local(), mesh, b.placements, run_check=False, shape=b.shape, stride=b.stride()
            )
            assert ref._spec == b._spec

    run_threaded(body, 2)


def test_release_shard_only_when_nobody_else_holds_it() -> None:
    def body(rank: int, world: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world,))
        buf = DBuffer(contiguous_layout([6, 8], world), [(2, 3), (8,)], mesh)
        views = sharded_views(buf)
        assert views_held_elsewhere(buf)  # nothing claimed yet: never freed
        assert not buf.release_shard()
        buf.claim_views()
        held: list[Callable[[], Any]] = [
            lambda: sharded_views(buf)[0],  # one of the buffer's own objects
            lambda: sharded_views(buf)[1].to_local(),  # noqa: PLW0108
            lambda: sharded_views(buf)[0].to_local().view(-1),  # a new tensor over it
            lambda: buf.shard[1:],
            lambda: buf.local_views()[1].detach(),  # noqa: PLW0108
        ]
        for make in held:
            kept = make()
            assert views_held_elsewhere(buf)
            assert not buf.release_shard()
            assert buf.shard_allocated
            del kept
            assert not views_held_elsewhere(buf)
        impl = buf.shard.untyped_storage()._cdata  # an int: holding the storage would count
        assert buf.release_shard()
        assert not buf.shard_allocated
        with pytest.raises(RuntimeError, match="shard storage is released"):
            buf.zero_()
        with pytest.raises(RuntimeError, match="shard storage is released"):
            buf.unshard()
        buf.alloc_shard(zero=True)
        assert buf.shard.untyped_storage()._cdata == impl  # the same storage object
        assert sharded_views(buf) is views  # the same objects, over the new memory
        buf.shard.fill_(3.0)
        assert all(bool((v.to_local() == 3.0).all()) for v in views)
        assert buf.release_shard()  # and again, with the same claim

    run_threaded(body, 2)


def test_storage_use_count_is_available() -> None:
    """torch's private storage use count, which the in-place reuse relies on (fails if torch
    drops it: the reuse would then silently stop)."""
    t = torch.zeros(4)
    base = refs.storage_use_count(t)
    assert isinstance(base, int)
    view = t[1:]
    assert refs.storage_use_count(t) == base + 1
    del view
    assert refs.storage_use_count(t) == base


def test_claim_counts_are_stable() -> None:
    t = torch.zeros(4)
    views = [t[:2], t[2:]]
    claim = refs.Claim(t, [t, *views])
    assert not claim.unchanged()  # not marked yet
    claim.mark()
    assert claim.unchanged()
    kept = views[0]
    assert not claim.unchanged()
    del kept
    assert claim.unchanged()
    other = torch.zeros(4)
    claim = refs.Claim(other, [other])
    claim.mark()
    assert claim.unchanged()
