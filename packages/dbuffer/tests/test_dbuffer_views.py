"""Zero-copy views, fused group ops and input checks (threaded process group)."""

from __future__ import annotations

import pytest
import torch
from dbuffer_helpers import BLOCKS, SHAPES, DispatchedOps, make_tensors
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from dbuffer import DBuffer, LayoutMismatchError, contiguous_layout
from dbuffer.testing import load_full_, sharded_views
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded


def _layout(world: int, align: int = 1) -> object:
    return contiguous_layout(
        [torch.Size(s).numel() for s in SHAPES], world, blocks=BLOCKS, align=align
    )


def _zero_copy(rank: int, world: int, align: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    layout = _layout(world, align)
    full = make_tensors(SHAPES, seed=0)
    buf = load_full_(DBuffer(layout, SHAPES, mesh), full)  # type: ignore[arg-type]
    shard_ptr = buf.shard.untyped_storage().data_ptr()
    size = buf.shard_size
    for i, (dt, shape) in enumerate(zip(sharded_views(buf), SHAPES, strict=True)):
        assert isinstance(dt, DTensor)
        assert dt.shape == torch.Size(shape)
        (placement,) = dt.placements
        assert isinstance(placement, RaggedShard)
        assert placement.local_units == layout.local_units(i)  # type: ignore[attr-defined]
        local = dt._local_tensor
        # The local tensor is the shard storage itself, at the offset the layout gives.
        assert local.untyped_storage().data_ptr() == shard_ptr
        offset = layout.offsets[i]  # type: ignore[attr-defined]
        numel = torch.Size(shape).numel()
        lo = min(max(offset, rank * size), (rank + 1) * size)
        hi = max(lo, min(offset + numel, (rank + 1) * size))
        assert local.numel() == hi - lo
        if local.numel():
            assert local.storage_offset() == lo - rank * size
        # Its values are the rank's flat range of the full tensor, as RaggedShard defines it.
        rng = placement.flat_range(shape, rank)
        assert torch.equal(dt.to_local(), full[i].reshape(-1)[rng.start : rng.stop])
        # Writing through the DTensor writes the buffer (and vice versa).
        if local.numel():
            dt.to_local()[0] = 1234.0
            assert buf.shard[local.storage_offset()] == 1234.0
    load_full_(buf, full)
    buf.unshard()
    flat_ptr = buf.unsharded.untyped_storage().data_ptr()
    for i, view in enumerate(buf.full_views()):
        assert type(view) is torch.Tensor and view.shape == torch.Size(SHAPES[i])
        assert view.untyped_storage().data_ptr() == flat_ptr
        assert view.storage_offset() == layout.offsets[i]  # type: ignore[attr-defined]
        assert view.is_contiguous()
        assert torch.equal(view, full[i])
    # The same view objects every time (made once, reused every step).
    assert buf.full_views() is buf.full_views()
    views_before = buf.full_views()
    buf.reshard()
    buf.unshard()
    assert all(a is b for a, b in zip(views_before, buf.full_views(), strict=True))
    assert all(torch.equal(v, f) for v, f in zip(buf.full_views(), full, strict=True))


@pytest.mark.parametrize(("world", "align"), [(2, 1), (4, 1), (3, 4)])
def test_views_are_zero_copy_slices_of_the_buffer(world: int, align: int) -> None:
    run_threaded(_zero_copy, world, align)


def _hsdp_placements(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2))
    buf = DBuffer(_layout(2), SHAPES, mesh)  # type: ignore[arg-type]
    for dt in sharded_views(buf):
        assert dt.placements[0] == Replicate()
        assert isinstance(dt.placements[1], RaggedShard)
        assert (
            dt._local_tensor.untyped_storage().data_ptr() == buf.shard.untyped_storage().data_ptr()
        )


def test_hsdp_views_replicate_on_axis_0() -> None:
    run_threaded(_hsdp_placements, 4)


def _fused_ops(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    layout = _layout(world)
    a = load_full_(DBuffer(layout, SHAPES, mesh), make_tensors(SHAPES, 1))  # type: ignore[arg-type]
    b = load_full_(a.new_like(), make_tensors(SHAPES, 2))
    ref_a, ref_b = a.shard.clone(), b.shard.clone()
    with DispatchedOps() as ops:
        a.scale_(0.5)
    assert ops.compute() == ["aten.mul_.Tensor"], ops.ops
    assert torch.equal(a.shard, ref_a * 0.5)
    with DispatchedOps() as ops:
        a.add_(b, alpha=2.0)
    assert ops.compute() == ["aten.add_.Tensor"], ops.ops
    assert torch.equal(a.shard, ref_a * 0.5 + 2.0 * ref_b)
    with DispatchedOps() as ops:
        a.copy_(b)
    assert ops.compute() == ["aten.copy_.default"]
    assert torch.equal(a.shard, ref_b)
    with DispatchedOps() as ops:
        low = a.to(torch.bfloat16)
    allocation = {"aten.zeros.default", "aten.zero_.default", "aten.empty.memory_format"}
    assert [op for op in ops.compute() if op not in allocation] == ["aten.copy_.default"]
    assert low.dtype == torch.bfloat16 and torch.equal(low.shard, ref_b.to(torch.bfloat16))
    assert low.geometry.same(a.geometry)
    with DispatchedOps() as ops:
        a.zero_()
    assert ops.compute() == ["aten.zero_.default"]
    assert not a.shard.any()
    # The grads' unsharded storage: one kernel zeroes the whole group.
    a.alloc_unsharded()
    with DispatchedOps() as ops:
        a.zero_("unsharded")
    assert ops.compute() == ["aten.zero_.default"]
    # The sharded views see every fused op (they are views of the same storage).
    b.scale_(0.0)
    assert all(not dt.to_local().any() for dt in sharded_views(b))


def test_fused_group_ops_are_one_kernel_per_group() -> None:
    run_threaded(_fused_ops, 2)


def _bad_tensors(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    names = [f"layers.0.p{i}" for i in range(len(SHAPES))]
    buf = DBuffer(_layout(world), SHAPES, mesh, names=names)  # type: ignore[arg-type]
    good = make_tensors(SHAPES, 0)
    wrong_numel = [*good[:3], torch.zeros(36, 16), *good[4:]]
    with pytest.raises(ValueError, match=r"tensor 'layers.0.p3' \(index 3\): has 576 elements"):
        load_full_(buf, wrong_numel)
    wrong_dtype = [*good[:1], good[1].double(), *good[2:]]
    with pytest.raises(ValueError, match=r"'layers.0.p1' \(index 1\): dtype torch.float64"):
        load_full_(buf, wrong_dtype)
    wrong_device = [*good[:2], good[2].to("meta"), *good[3:]]
    with pytest.raises(ValueError, match=r"'layers.0.p2' \(index 2\): on device meta"):
        load_full_(buf, wrong_device)
    with pytest.raises(ValueError, match="got 2 tensors for 9 slots"):
        load_full_(buf, good[:2])
    with pytest.raises(RuntimeError, match="unsharded storage is not allocated"):
        buf.reduce_scatter()
    other = DBuffer(contiguous_layout([5], world), [(5,)], mesh, check=False)
    with pytest.raises(ValueError, match="different layout"):
        buf.add_(other)
    with pytest.raises(ValueError, match="layout is for world_size 3"):
        DBuffer(contiguous_layout([5], 3), [(5,)], mesh)
    with pytest.raises(TypeError, match=r"does not satisfy dbuffer\.BufferLayout"):
        DBuffer(object(), [(5,)], mesh)  # type: ignore[arg-type]


def test_bad_tensors_raise_naming_them() -> None:
    run_threaded(_bad_tensors, 2)


def _mismatch(rank: int, world: int, what: str) -> str:
    mesh = init_device_mesh("cpu", (world,))
    try:
        if what == "layout":
            layout = contiguous_layout([10, 6], world, align=4 if rank == world - 1 else 1)
            DBuffer(layout, [(10,), (6,)], mesh)
        else:
            dtype = torch.bfloat16 if rank == 0 else torch.float32
            DBuffer(contiguous_layout([10, 6], world), [(10,), (6,)], mesh, dtype=dtype)
    except LayoutMismatchError as exc:
        # Caught here: the threaded PG stops the other threads as soon as one thread raises, so
        # letting it escape would hide whether the others raise too.
        return str(exc)
    return "no error"


@pytest.mark.parametrize("what", ["layout", "dtype"])
def test_layout_mismatch_raises_on_every_rank(what: str) -> None:
    messages = run_threaded(_mismatch, 4, what, timeout=30)
    assert len(set(messages)) == 1, messages  # every rank raised, with the same verdict
    text = messages[0]
    if what == "layout":
        assert "layout fingerprint: ranks [0, 1, 2] have 'contiguous:" in text
        assert "ranks [3] have 'contiguous:" in text
    else:
        expected = "dtype: ranks [0] have 'torch.bfloat16', ranks [1, 2, 3] have 'torch.float32'"
        assert expected in text
