"""torch's full-state-dict load (``StateDictOptions(full_state_dict=True,
broadcast_from_rank0=True)``) gives each rank its RaggedShard share, into meta and into existing
DTensors, on 1-D and 2-D meshes, with no temporary of the full or the box's size.

torch's ``_distribute_tensors`` (the step after the broadcast) cuts shares as boxes
``full[slices]``; the integration hands it ragged pairs' shares cut from the flat range
([Note: why torch's state-dict loader needs a hook] in ``state_dict.py``). Values are copies of
the full tensor's elements: compared bitwise against ``distribute_tensor``'s share and against
``full.reshape(-1)[range]``.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import _state_dict_utils as sdu
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh

from ragged_dtensor import RaggedShard, distribute_tensor, hooks_installed
from ragged_dtensor._private.state_dict import copy_flat_range
from ragged_dtensor.testing import run_processes, run_threaded


def _views() -> list[tuple[str, torch.Tensor]]:
    base = torch.arange(2 * 5 * 6, dtype=torch.float32).reshape(2, 5, 6)
    return [
        ("1-D", torch.arange(7.0)),
        ("contiguous 3-D", base),
        ("columns of a matrix", base[0, :, 1:4]),
        ("inner slice of 3-D", base[:, 1:4, 2:5]),
        ("transposed", base[1].t()),
    ]


@pytest.mark.parametrize("name", [n for n, _ in _views()])
def test_copy_flat_range_copies_every_range_of_a_strided_view(name: str) -> None:
    """Every ``[start, stop)`` of the view's row-major order, without flattening the view."""
    src = dict(_views())[name]
    flat = src.reshape(-1)
    for start, stop in itertools.combinations_with_replacement(range(src.numel() + 1), 2):
        dst = torch.full((stop - start,), -1.0)
        copy_flat_range(dst, src, start, stop)
        assert torch.equal(dst, flat[start:stop]), (name, start, stop)


# -- torch's _distribute_tensors, called as torch's broadcast path calls it ---------------------

_LAYOUTS: dict[str, tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]] = {
    # mesh shape, placements, global shape
    "1-D, shares cut rows": ((2,), (RaggedShard((0,), (1, 2)),), (6, 5)),
    "1-D, one rank empty": ((2,), (RaggedShard((0,), (0, 3)),), (6, 5)),
    "1-D, 2-D units": ((2,), (RaggedShard((0, 1), (3, 7)),), (2, 5, 3)),
    "2-D, TP columns then ragged": ((2, 2), (RaggedShard((0,), (1, 3)), Shard(1)), (8, 6)),
    "2-D, rows then ragged": ((2, 2), (Shard(0), RaggedShard((0, 1), (2, 1))), (4, 6)),
    "2-D, replicated (HSDP)": ((2, 2), (Replicate(), RaggedShard((0,), (3, 1))), (4, 3)),
}


def _distribute_case(rank: int, world: int, layout: str) -> dict[str, bool]:
    mesh_shape, placements, shape = _LAYOUTS[layout]
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    want = distribute_tensor(full, mesh, placements, src_data_rank=None)
    meta = distribute_tensor(
        torch.empty(shape, device="meta"), mesh, placements, src_data_rank=None
    )
    existing = distribute_tensor(torch.zeros(shape), mesh, placements, src_data_rank=None)
    existing_local = existing.to_local()
    plain = distribute_tensor(full, mesh, [Replicate()] * len(mesh_shape), src_data_rank=None)
    state: dict[str, Any] = {
        "meta": (meta, full),
        "existing": (existing, full),
        "not ragged": (plain, full),
    }
    sdu._distribute_tensors(state, list(state), torch.device("cpu"))
    got_meta, got_existing = state["meta"], state["existing"]
    return {
        "meta: a ragged DTensor with the share": isinstance(got_meta, DTensor)
        and got_meta.placements == tuple(placements)
        and not got_meta.is_meta
        and torch.equal(got_meta.to_local(), want.to_local())
        and torch.equal(got_meta.full_tensor(), full),
        "existing: the share copied in place": got_existing is existing
        and got_existing.to_local().data_ptr() == existing_local.data_ptr()
        and torch.equal(existing_local, want.to_local()),
        "other placements: torch's own": torch.equal(state["not ragged"].to_local(), full),
    }


@pytest.mark.parametrize("layout", list(_LAYOUTS))
def test_torchs_distribute_step_gives_each_rank_its_ragged_share(layout: str) -> None:
    world = 1
    for size in _LAYOUTS[layout][0]:
        world *= size
    for result in run_threaded(_distribute_case, world, layout, timeout=120):
        assert result == dict.fromkeys(result, True), (layout, result)
    assert hooks_installed()["state_dict"]


def _mismatch(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(torch.zeros(6, 5), mesh, [RaggedShard((0,), (1, 2))])
    state: dict[str, Any] = {"layer.weight": (dt, torch.zeros(5, 6))}
    try:
        sdu._distribute_tensors(state, ["layer.weight"], torch.device("cpu"))
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_full_tensor_of_another_shape_is_refused_naming_the_key() -> None:
    for message in run_threaded(_mismatch, 2):
        assert "size mismatch for layer.weight" in message, message
        assert "(5, 6)" in message and "(6, 5)" in message, message


# -- the public call, on gloo processes ------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(6, 5))
        self.b = nn.Parameter(torch.empty(7))


def _set_full(rank: int, world: int) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = {"w": torch.randn(6, 5, generator=gen), "b": torch.randn(7, generator=gen)}
    placements = {"w": [RaggedShard((0,), (1, 2))], "b": [RaggedShard((0,), (7, 0))]}
    out = {}
    for init in ("meta", "existing"):
        with torch.device("meta" if init == "meta" else "cpu"):
            net = _Net()
        for name, param in list(net.named_parameters()):
            placed = distribute_tensor(param.detach(), mesh, placements[name], src_data_rank=None)
            setattr(net, name, nn.Parameter(placed))
        given = {k: v.clone() for k, v in full.items()} if rank == 0 else {}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(net, given, options=options)
        read = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True))
        out[init] = all(torch.equal(read[k], full[k]) for k in full) and all(
            p.placements == tuple(placements[n]) for n, p in net.named_parameters()
        )
    return out


@pytest.mark.multiprocess
def test_set_model_state_dict_from_rank0_loads_ragged_parameters() -> None:
    """``set_model_state_dict`` with ``broadcast_from_rank0`` into a module whose parameters are
    ragged DTensors (meta, and existing): every rank reads back rank 0's full tensors."""
    for result in run_processes(_set_full, 2, timeout=120):
        assert result == {"meta": True, "existing": True}, result
