"""The live-bytes tally, and that unsharded storage is really released (threaded process group)."""

from __future__ import annotations

import gc

import pytest
import torch
from dbuffer_helpers import BLOCKS, SHAPES, make_tensors
from torch.distributed.device_mesh import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import CopiedBytes, LiveBytes, load_full_
from ragged_dtensor.testing import run_threaded


def test_live_bytes_follows_allocation_free_and_resize() -> None:
    seed = torch.zeros(10)
    with LiveBytes(seed=[seed]) as live:
        assert live.current == 40
        a = torch.empty(100)
        assert live.current == 440
        view = a[10:20]  # a view allocates nothing
        assert live.current == 440
        a.untyped_storage().resize_(0)
        assert live.current == 40
        a.untyped_storage().resize_(400)
        assert live.current == 440
        b = a * 2  # a new storage
        assert live.current == 840 and live.peak == 840
        del a, view, b
        gc.collect()
        assert live.current == 40
        assert live.peak == 840
        live.reset_peak()
        assert live.peak == 40
        a = torch.ones(3)
        a.add_(1)  # in place: no new storage
        assert live.current == 52
    # resize_ is restored once no tally is active
    assert getattr(torch.UntypedStorage.resize_, "__name__", "") != "_patched_resize"


def test_live_bytes_device_filter_and_meta() -> None:
    with LiveBytes(device="cuda") as live:
        torch.empty(100)
        torch.empty(100, device="meta")
    assert live.current == 0 and live.peak == 0


def test_copied_bytes_counts_destinations() -> None:
    a, b = torch.zeros(8), torch.ones(8)
    with CopiedBytes() as copied:
        a.copy_(b)
        torch.cat([a, b])
        b.to(torch.float64)
        a.add_(b)  # not a copy
    assert copied.by_op == {"aten::copy_": 32, "aten::cat": 64, "aten::_to_copy": 64}
    assert copied.total == 160


def _released(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    layout = contiguous_layout([torch.Size(s).numel() for s in SHAPES], world, blocks=BLOCKS)
    buf = load_full_(DBuffer(layout, SHAPES, mesh), make_tensors(SHAPES, 0))  # type: ignore[arg-type]
    shard_bytes = buf.shard_size * 4
    full_bytes = world * shard_bytes
    storage = buf.unsharded.untyped_storage()
    with LiveBytes(seed=[buf.shard]) as live:
        assert live.current == shard_bytes
        for _ in range(3):  # steady state: no growth over steps
            buf.unshard()
            assert live.current == shard_bytes + full_bytes
            buf.reshard()
            # Released now (not whenever an allocator decides), the same storage object.
            assert live.current == shard_bytes
            assert storage.nbytes() == 0 and buf.unsharded.untyped_storage() is storage
        assert live.peak == shard_bytes + full_bytes
        live.reset_peak()
        # Mixed precision: the shard is cast straight into this rank's slot of the bf16 output,
        # the all-gather's input ([Note: a cast all-gathered in place]): no temporary shard.
        buf.unshard(dtype=torch.bfloat16)
        assert live.current == shard_bytes + full_bytes // 2
        assert live.peak == shard_bytes + full_bytes // 2
        buf.reshard()
        assert live.current == shard_bytes
        # Gradients: the unsharded grad storage exists from allocation to the reduce-scatter.
        grads = buf.new_like()
        live.track(grads.shard)
        grads.alloc_unsharded(zero=True)
        assert live.current == 2 * shard_bytes + full_bytes
        grads.reduce_scatter(op="avg")
        assert live.current == 2 * shard_bytes
        grads.alloc_unsharded(zero=True)
        handle = grads.reduce_scatter(async_op=True)
        assert live.current >= 2 * shard_bytes + full_bytes  # held until wait()
        handle.wait()
        assert live.current == 2 * shard_bytes


@pytest.mark.parametrize("world", [2, 4])
def test_unsharded_storage_is_released_after_reshard(world: int) -> None:
    run_threaded(_released, world)
