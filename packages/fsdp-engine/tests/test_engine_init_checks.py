"""What ``fully_shard`` decides and checks at setup: the frozen-values digest (computed where
the values are, in bounded memory), the device (its index honoured), one sub-group per
(mesh, k) for ``reshard_after_forward=k``, and presence flags summed on the host side of the
backend."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import fsdp_engine
from dbuffer.testing import LiveBytes
from fsdp_engine._private import digest as digest_module
from fsdp_engine._private.digest import value_digest
from fsdp_engine._private.init import choose_device
from fsdp_engine._private.presence import _sum_over_mesh
from fsdp_engine._private.state import get_state
from ragged_dtensor.testing import run_processes, run_threaded


def test_the_digest_tells_copies_apart() -> None:
    base = torch.arange(1000, dtype=torch.float32)
    same = base.clone()
    swapped = base.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    flipped = base.clone()
    flipped.view(torch.int32)[500] ^= 1  # one bit
    assert value_digest(base) == value_digest(same)
    assert value_digest(base) != value_digest(swapped)
    assert value_digest(base) != value_digest(flipped)
    odd = torch.ones(3, dtype=torch.bfloat16)  # 6 bytes: padded to whole words
    assert value_digest(odd) != value_digest(torch.zeros(3, dtype=torch.bfloat16))
    assert value_digest(base).startswith("(1000,) torch.float32 digest:")


def test_the_digest_reads_nothing_to_the_host_and_bounds_its_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 24, defect 7: the frozen-values agreement copied every frozen parameter to the
    host (``.cpu()`` and numpy bytes: minutes and a host-memory spike for LoRA on a large
    model). Now only the two 64-bit lanes are read back, and the temporaries are a chunk's."""
    monkeypatch.setattr(digest_module, "_DIGEST_CHUNK", 1 << 18)  # 256 Ki words a chunk
    param = torch.randn(1 << 22)  # 16 MiB of fp32: 16 chunks
    expected = value_digest(param)

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the digest copied the parameter to the host")

    monkeypatch.setattr(torch.Tensor, "cpu", refuse)
    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    with LiveBytes() as live:
        assert value_digest(param) == expected
    # four int64 temporaries of one chunk (words, indices, xor, product): 8 MiB, half the
    # parameter's 16 MiB whatever its size
    assert live.peak <= 4 * 8 * (1 << 18) + 64, live.peak  # and the two lanes


def test_the_device_index_is_honoured() -> None:
    """Issue 24, defect 7: a model on ``cuda:3`` without ``set_device`` stays on ``cuda:3`` (the
    storage was made on the current device, silently moving it). The rule itself: the
    parameters' device, the mesh's current device only for meta parameters."""
    assert choose_device({torch.device("cuda", 3): "w"}, "cuda") == torch.device("cuda", 3)
    assert choose_device({torch.device("cpu"): "w"}, "cpu") == torch.device("cpu")
    assert choose_device({}, "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="parameters on different devices"):
        choose_device({torch.device("cuda", 0): "a", torch.device("cuda", 1): "b"}, "cuda")
    with pytest.raises(ValueError, match="'w' is on cpu but the mesh is cuda"):
        choose_device({torch.device("cpu"): "w"}, "cuda")


_BUILD = threading.Lock()


def _subgroups(rank: int, world: int) -> tuple[bool, int]:
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    for layer in model:
        fsdp_engine.fully_shard(layer, mesh=mesh, reshard_after_forward=2)
    parts = [get_state(layer).groups[0].post_forward_part for layer in model]  # type: ignore[union-attr]
    groups = {id(p.group) for p in parts if p is not None}
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # the shared sub-group re-gathers every layer
    return len(groups) == 1, len(parts)


def test_one_subgroup_per_mesh_and_k() -> None:
    """Issue 24, defect 6: every group with ``reshard_after_forward=k`` built its own
    DeviceMesh, i.e. its own communicator; now one per (mesh, k)."""
    for shared, count in run_threaded(_subgroups, 4):
        assert shared and count == 3


def _presence_on_host(rank: int, world: int) -> list[bool]:
    mesh = init_device_mesh("cpu", (world,))
    # the flags never go to a device (an accelerator-only group gets a gloo group of its own:
    # test_exact_presence_on_an_accelerator_only_group_never_goes_through_the_device)
    return _sum_over_mesh([rank == 0, False, True], mesh)


def test_presence_flags_are_summed_on_the_host_side_of_the_backend() -> None:
    """Issue 24, defect 8: ``set_reduce_scatter_unused_params(False)`` made a pageable
    host-to-device copy and read the result back per group per backward; with a backend that
    serves CPU tensors (gloo, or the CPU part of ``cpu:gloo,cuda:nccl``) the flags never leave
    the host."""
    for flags in run_processes(_presence_on_host, 2, timeout=60):  # gloo: a CPU backend
        assert flags == [True, False, True]
