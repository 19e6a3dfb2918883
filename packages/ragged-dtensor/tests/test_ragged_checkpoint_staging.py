"""Checkpoints off the training path (issue 28): the ``new_*`` factories DCP and optimizers call
with a shape other than the global one behave as torch's Shard(0) does (the control), and every DCP
entry point that stages or copies tensors (``async_save``, the state-dict stagers of
``torch.distributed.checkpoint.staging``, ``_create_cpu_state_dict`` + ``_copy_state_dict``,
``get_state_dict(cpu_offload=True)``) round-trips a dict of RaggedShard DTensors bit for bit, at the
same and at other world sizes, into ragged and Shard layouts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.staging import (
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor, Shard, init_device_mesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from ragged_dtensor import (
    RaggedShard,
    distribute_tensor,
    from_local,
    install_dtensor_integration,
    own_storage_view,
    uninstall_dtensor_integration,
)
from ragged_dtensor.testing import run_processes, run_threaded

# -- new_* factories: torch's Shard(0) is the control ----------------------------------------------

_FACTORIES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "new_empty([]) (DCP's stager)": lambda t: t.new_empty([], device="cpu"),
    "new_empty([3, 2])": lambda t: t.new_empty([3, 2]),
    "new_zeros([5])": lambda t: t.new_zeros([5]),
    "new_ones([2, 3], float64)": lambda t: t.new_ones([2, 3], dtype=torch.float64),
    "new_full([4], 7)": lambda t: t.new_full([4], 7.0),
    "new_empty_strided([2, 3], [1, 2])": lambda t: t.new_empty_strided([2, 3], [1, 2]),
    # the global shape: each follows its operand's placement
    "new_zeros(global shape)": lambda t: t.new_zeros(t.shape),
    "new_full(global shape, 2)": lambda t: t.new_full(t.shape, 2.0),
    "zeros_like": torch.zeros_like,
    "full_like(3)": lambda t: torch.full_like(t, 3.0),
}
_INITIALISED = ("new_zeros", "new_ones", "new_full", "zeros_like", "full_like")


def _describe(out: torch.Tensor) -> dict[str, Any]:
    assert isinstance(out, DTensor)
    local = out.to_local()
    described: dict[str, Any] = {
        "shape": tuple(out.shape),
        "stride": out.stride(),
        "dtype": out.dtype,
        "device": out.device,
        "local shape": tuple(local.shape),
        "local stride": local.stride(),
    }
    return described


def _factories(rank: int, world: int, mesh_shape: tuple[int, ...]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    units = (1, 3) if mesh_shape[0] == 2 else (4,)
    ragged_placements: list[Placement] = [RaggedShard((0,), units)]
    shard_placements: list[Placement] = [Shard(0)]
    if len(mesh_shape) == 2:  # (dp, tp): the ragged axis cuts what Shard(1) leaves
        ragged_placements.append(Shard(1))
        shard_placements.append(Shard(1))
    ragged = distribute_tensor(full, mesh, ragged_placements)
    control = distribute_tensor(full, mesh, shard_placements)
    out: dict[str, Any] = {}
    for name, make in _FACTORIES.items():
        ours, theirs = make(ragged), make(control)
        assert isinstance(ours, DTensor) and isinstance(theirs, DTensor)
        same_shape = tuple(ours.shape) == tuple(full.shape)
        if same_shape:  # ragged stays ragged over its own share; Shard(0) stays Shard(0)
            assert ours.placements == ragged.placements, (name, ours.placements)
            assert theirs.placements == control.placements, (name, theirs.placements)
            assert ours.to_local().shape == ragged.to_local().shape, name
            assert {k: v for k, v in _describe(ours).items() if "local" not in k} == {
                k: v for k, v in _describe(theirs).items() if "local" not in k
            }, name
        else:
            assert ours.placements == theirs.placements, (name, ours.placements, theirs.placements)
            assert _describe(ours) == _describe(theirs), (name, _describe(ours), _describe(theirs))
        if name.startswith(_INITIALISED):  # same values as torch (empty ones hold garbage)
            assert torch.equal(ours.full_tensor(), theirs.full_tensor()), name
        out[name] = (ours.placements, tuple(ours.shape))
    return out


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_new_factories_of_another_shape_are_replicate_like_torchs_shard(
    mesh_shape: tuple[int, ...],
) -> None:
    world = 1
    for size in mesh_shape:
        world *= size
    results = run_threaded(_factories, world, mesh_shape)
    replicated = (Replicate(),) * len(mesh_shape)
    for placements, shape in (results[0][k] for k in _FACTORIES if "global" not in k):
        if shape != (8, 6):
            assert placements == replicated
    assert results[0]["new_empty([]) (DCP's stager)"] == (replicated, ())


# -- DCP entry points on real gloo processes ------------------------------------------------------

SHAPES = {"a": (7, 5, 3), "b": (10, 4), "c": (6,), "empty": (0, 4)}


def _fulls() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    out = {name: torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}
    out["c"] = out["c"].to(torch.bfloat16)
    out["ints"] = torch.randint(-(2**40), 2**40, (9, 2), generator=gen)
    return out


def _save_layout(world: int) -> dict[str, Placement]:
    last = (0,) * (world - 1) + (1,)
    return {
        "a": RaggedShard((0, 1), (2, 5) if world == 2 else (1,) * world),  # shares are not boxes
        "b": RaggedShard((), last),  # a Muon-style root: one rank holds it all
        "c": RaggedShard((0,), (1, 2) if world == 2 else (1,) * world),
        "empty": RaggedShard((0,), (1,) * world),
        "ints": RaggedShard((0,), (1, 2) if world == 2 else (1,) * world),
    }


def _load_layouts(world: int) -> dict[str, dict[str, Placement]]:
    units = {
        1: [(1,)] * 5,
        2: [(5, 2), (3, 2), (2, 1), (1, 1), (2, 1)],
        3: [(1, 4, 2), (0, 0, 1), (1, 1, 1), (1, 1, 1), (1, 1, 1)],
    }[world]
    names = ["a", "b", "c", "empty", "ints"]
    return {
        "ragged": {name: RaggedShard((0,), u) for name, u in zip(names, units, strict=True)},
        "shard": dict.fromkeys(names, Shard(0)),
    }


class _Net(nn.Module):
    def __init__(self, mesh: Any, fulls: dict[str, torch.Tensor], layout: dict[str, Any]) -> None:
        super().__init__()
        self.a = nn.Parameter(distribute_tensor(fulls["a"], mesh, [layout["a"]]))
        self.b = nn.Parameter(distribute_tensor(fulls["b"], mesh, [layout["b"]]))


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _save(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    fulls = _fulls()
    layout = _save_layout(world)
    state = {k: distribute_tensor(v, mesh, [layout[k]]) for k, v in fulls.items()}
    staged: dict[str, Any] = {}

    future = dcp.async_save(state, checkpoint_id=f"{root}/async_save")
    future.result()

    # async_save's own options (no pinning, sharing, background thread or non-blocking copy)
    stager = DefaultStager(StagingOptions(False, False, False, False))
    staged["staging.DefaultStager"] = stager.stage(state)
    stager.close()
    blocking = BlockingAsyncStager()
    staged["staging.BlockingAsyncStager"] = blocking.stage(state)
    blocking.close()
    dcp.save(staged["staging.DefaultStager"], checkpoint_id=f"{root}/default_stager")

    cpu = _create_cpu_state_dict(state)
    staged["_create_cpu_state_dict+_copy_state_dict"] = _copy_state_dict(state, cpu)
    dcp.save(cpu, checkpoint_id=f"{root}/copy_state_dict")

    dcp.save(state, checkpoint_id=f"{root}/save")

    # get_state_dict(cpu_offload=True) of a module whose parameters are ragged, with torch's
    # AdamW state (zeros_like of each parameter: ragged too) after one step
    net = _Net(mesh, fulls, layout)
    opt = torch.optim.AdamW(net.parameters(), lr=0.1)
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    model_sd, optim_sd = get_state_dict(net, opt, options=StateDictOptions(cpu_offload=True))
    offloaded = {"model": model_sd, "optim": optim_sd}
    dcp.save(offloaded, checkpoint_id=f"{root}/cpu_offload")
    full_model, _ = get_state_dict(
        net, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )

    # every staged copy holds the same values and layout as the state it copied
    for name, copy in staged.items():
        for key, value in state.items():
            assert isinstance(copy[key], DTensor), (name, key)
            assert copy[key].placements == value.placements, (name, key)
            assert copy[key].to_local().device.type == "cpu", (name, key)
            assert torch.equal(copy[key].to_local(), value.to_local()), (name, key)
    return {
        "state": _full(state),
        "offloaded": _full(offloaded["model"] | {"exp_avg": optim_sd["state"]["a"]["exp_avg"]}),
        "full model on rank 0": _full(full_model) if rank == 0 else None,
        "params": _full(dict(net.named_parameters())),
        "exp_avg": _full(opt.state[net.a]["exp_avg"]),
    }


CHECKPOINTS = ("async_save", "default_stager", "copy_state_dict", "save")


def _load(rank: int, world: int, root: str) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    fulls = _fulls()
    out: dict[str, Any] = {}
    for layout_name, layout in _load_layouts(world).items():
        for checkpoint in CHECKPOINTS:
            state = {
                k: distribute_tensor(torch.zeros_like(v), mesh, [layout[k]])
                for k, v in fulls.items()
            }
            dcp.load(state, checkpoint_id=f"{root}/{checkpoint}")
            out[f"{checkpoint} -> {layout_name}"] = _full(state)
        like = {k: distribute_tensor(torch.zeros_like(fulls[k]), mesh, [layout[k]]) for k in "ab"}
        exp_avg = distribute_tensor(torch.zeros_like(fulls["a"]), mesh, [layout["a"]])
        template = {"model": like, "optim": {"state": {"a": {"exp_avg": exp_avg}}}}
        dcp.load(template, checkpoint_id=f"{root}/cpu_offload")
        out[f"cpu_offload -> {layout_name}"] = _full(like) | {"exp_avg": exp_avg.full_tensor()}
    return out


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], where: str) -> None:
    assert a.keys() == b.keys(), where
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), (where, key)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """One spawn of 2 gloo ranks saves through every entry point."""
    root = tmp_path_factory.mktemp("ragged_staging")
    return root, run_processes(_save, 2, str(root), timeout=240)


@pytest.mark.multiprocess
def test_staged_and_offloaded_state_dicts_equal_the_state(
    saved: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, results = saved
    fulls = _fulls()
    for rank in range(2):
        _bitwise(results[rank]["state"], fulls, f"rank {rank}: saved state")
        trained = results[rank]["params"] | {"exp_avg": results[rank]["exp_avg"]}
        _bitwise(results[rank]["offloaded"], trained, f"rank {rank}: cpu_offload state dict")
    _bitwise(results[0]["full model on rank 0"], results[0]["params"], "full_state_dict")
    assert results[1]["full model on rank 0"] is None


@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [1, 2, 3])
def test_staged_and_async_checkpoints_load_bitwise_at_any_world_size(
    saved: tuple[Path, list[dict[str, Any]]], world: int
) -> None:
    root, results = saved
    fulls = _fulls()
    assert fulls["empty"].numel() == 0  # the zero-element key is saved and loaded too
    trained = results[0]["params"] | {"exp_avg": results[0]["exp_avg"]}
    loaded = run_processes(_load, world, str(root), timeout=240)
    for rank in range(world):
        assert len(loaded[rank]) == 2 * (len(CHECKPOINTS) + 1)
        for name, values in loaded[rank].items():
            expected = trained if name.startswith("cpu_offload") else fulls
            _bitwise(values, expected, f"world {world}, rank {rank}: {name}")


# -- DTensors over views at a storage offset: torch's stager limit, Shard(0) as the control --------


def _offset_views(rank: int, world: int, root: str) -> dict[str, str]:
    """A DTensor over a view into a larger buffer (as a flat-buffer FSDP keeps its parameters):
    torch 2.13 gives it ``data_ptr() != 0`` and its state-dict stager then copies the DTensor's
    own (empty) storage and fails, for Shard(0) exactly as for RaggedShard, with the integration
    installed or not (it changes no DTensor's ``data_ptr``: [Note: a DTensor's data_ptr]). Over
    ``own_storage_view`` of the same view (no copy) both save as is, as do copies
    (``detach().clone()``: fresh local tensors)."""
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(24.0).reshape(6, 4)
    buffer = torch.zeros(64)
    placement = RaggedShard((0,), (1, 2))
    share = placement.flat_range(full.shape, rank)
    ragged_view = buffer[8 : 8 + share.numel]  # at offset 8 on every rank
    ragged_view.copy_(full.reshape(-1)[share.start : share.stop])
    shard_view = buffer[32:44].view(3, 4)
    shard_view.copy_(full[3 * rank : 3 * rank + 3])
    cases = {
        "ragged": from_local(ragged_view, mesh, [placement], shape=full.shape),
        "shard": DTensor.from_local(shard_view, mesh, [Shard(0)], run_check=False),
    }
    own = {
        "ragged": from_local(own_storage_view(ragged_view), mesh, [placement], shape=full.shape),
        "shard": DTensor.from_local(
            own_storage_view(shard_view), mesh, [Shard(0)], run_check=False
        ),
    }
    out: dict[str, str] = {}
    uninstall_dtensor_integration()  # torch alone: the limit
    try:
        out["torch data_ptr"] = str(cases["shard"].data_ptr())
        out["torch stager"] = _saved(cases["shard"], f"{root}/shard-torch", mesh, full)
    finally:
        install_dtensor_integration()
    out["installed data_ptr"] = str(cases["shard"].data_ptr())
    out["installed stager"] = _saved(cases["shard"], f"{root}/shard-installed", mesh, full)
    for name, dt in own.items():
        assert dt.storage_offset() == 0 and dt.data_ptr() == 0
        assert dt.to_local().untyped_storage().nbytes() == dt.to_local().numel() * 4
        for how, value in (("as is", dt), ("copied", dt.detach().clone())):
            path = f"{root}/{name}-{how.replace(' ', '_')}"
            out[f"{name} {how}"] = _saved(value, path, mesh, full)
    return out


def _saved(value: DTensor, path: str, mesh: Any, full: torch.Tensor) -> str:
    try:
        dcp.async_save({"t": value}, checkpoint_id=path).result()
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    target = {"t": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(1)])}
    dcp.load(target, checkpoint_id=path)
    return "ok" if torch.equal(target["t"].full_tensor(), full) else "WRONG"


@pytest.mark.multiprocess
def test_async_save_of_dtensors_over_offset_views(tmp_path: Path) -> None:
    """Pins torch 2.13's limit for a Shard(0) over an offset view (when torch's own stager
    saves it, drop the own_storage_view part), that the integration leaves it as torch has it,
    and that over ``own_storage_view`` both layouts save."""
    for outcome in run_processes(_offset_views, 2, str(tmp_path), timeout=240):
        assert outcome["torch data_ptr"] != "0", outcome
        assert "invalid python storage" in outcome["torch stager"], outcome
        assert outcome["installed data_ptr"] == outcome["torch data_ptr"], outcome
        assert outcome["installed stager"] == outcome["torch stager"], outcome
        for name in ("ragged", "shard"):
            assert outcome[f"{name} as is"] == "ok", outcome
            assert outcome[f"{name} copied"] == "ok", outcome
