"""The torch internals the engine uses, all in ``compat``: each is torch 2.13's own object and
still does what the engine relies on (a torch release that moves or changes one fails here)."""

from __future__ import annotations

import importlib

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate

from fsdp_engine._private import compat, compat_fsdp2
from ragged_dtensor.testing import run_threaded


def test_the_supported_release_and_every_entry_are_torch_s() -> None:
    assert torch.__version__.startswith(compat.SUPPORTED)
    status = compat.compat_status()
    assert status == {
        "torch": torch.__version__,
        "post_backward_function": "torch",
        "composable_registry": "marked",
        "torch_state_slot": "registered",
        "shard_placement_result": "torch",
        "strided_shard": "torch",
        "apply_to_tensors": "torch",
        "graph_task_id": "torch",
        "concatenate_meshes": "torch",
        "flatten_mesh": "torch",
        "preserve_version_counter": "torch",
    }, status
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import (
        RegisterPostBackwardFunction,
    )

    assert compat.PostBackwardFunction is RegisterPostBackwardFunction
    contract = importlib.import_module("torch.distributed._composable.contract")
    module = nn.Linear(2, 2)
    compat.mark_fully_sharded(module)
    assert "fully_shard" in module.__dict__[contract.REGISTRY_KEY]
    # torch's fully_shard.state finds what we register (pipelining's stage calls it)
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    marker = object()
    compat_fsdp2.register_torch_state(module, marker)
    assert torch_fully_shard.state(module) is marker  # type: ignore[attr-defined]
    assert compat_fsdp2.shard_placement_result_type() is ShardPlacementResult
    strided = compat_fsdp2.strided_shard(1, 2)
    assert isinstance(strided, _StridedShard) and strided == _StridedShard(1, split_factor=2)
    assert compat_fsdp2.is_shard_like(strided, 1) and compat_fsdp2.is_shard_like(Shard(1), 1)
    assert not compat_fsdp2.is_shard_like(Shard(0), 1)


def test_the_autograd_engine_entries() -> None:
    seen: list[bool] = []
    ran: list[str] = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(compat.in_backward())
        compat.queue_backward_callback(lambda: ran.append("end"))
        return grad

    y = (x * 2).sum()
    x.register_hook(hook)
    assert not compat.in_backward()
    y.backward()
    assert seen == [True] and ran == ["end"]


def test_version_counters_and_parameters() -> None:
    t = torch.zeros(3)
    before = t._version
    with compat.no_grad_and_preserved(t):
        t.add_(1)
    assert t._version == before and t.tolist() == [1.0, 1.0, 1.0]
    module = nn.Linear(2, 2)
    new = nn.Parameter(torch.ones(2))
    compat.set_registered_param(module, "bias", new)
    assert compat.registered_param(module, "bias") is new and module.bias is new
    marks: list[int] = []
    new.register_post_accumulate_grad_hook(lambda p: marks.append(1))  # type: ignore[no-untyped-call]
    hooks = compat.post_accumulate_grad_hooks(new)
    assert len(hooks) == 1
    hooks[0](new)
    assert marks == [1]


def _dtensors(rank: int, world: int) -> bool:
    parent = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    mesh = parent["dp"]
    value = DTensor.from_local(torch.ones(4) * rank, mesh, [Replicate()], run_check=False)
    local = compat.local_tensor(value)
    rebuilt = compat.dtensor_from_spec(local, compat.spec_of(value))
    assert compat.local_tensor(rebuilt) is local and rebuilt.placements == value.placements
    compat.set_local_tensor(rebuilt, torch.zeros(4))
    assert rebuilt.to_local().tolist() == [0.0] * 4
    both = compat.concatenate_meshes([parent["dp"], parent["tp"]])
    flat = compat.flatten_mesh(parent["dp", "tp"], "dp_tp")
    return bool(
        both.mesh.tolist() == parent.mesh.tolist()
        and flat.mesh.tolist() == list(range(world))
        and flat.mesh_dim_names == ("dp_tp",)
    )


def test_dtensor_and_mesh_entries() -> None:
    assert all(run_threaded(_dtensors, 4))


def test_profiler_enabled_follows_torchs_profilers() -> None:
    """The trace opens its ranges only while a profiler records (``compat.profiler_enabled``)."""
    assert not compat.profiler_enabled()
    with torch.profiler.profile():
        assert compat.profiler_enabled()
    with torch.autograd.profiler.profile():
        assert compat.profiler_enabled()
    assert not compat.profiler_enabled()
