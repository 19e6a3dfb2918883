"""The reduction strategies FSDP2 offers beyond one reduce-scatter per backward, against torch's
FSDP2 as the control ([Note: reduction strategies] in reduce_comm.py).

Numeric kind: *same arithmetic*. Both engines reduce the same per-element sums in the same order
(a reduce-scatter of each microbatch, the held results added in microbatch order, one all-reduce,
the same pre/post division), only laid out differently: compared bitwise.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from engine_fsdp2 import (
    ALL_REDUCE,
    REDUCE_SCATTER,
    Stack,
    counting,
    data,
    engine,
    full_grads,
    full_params,
    make,
    shard_stack,
)
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def _hsdp_window(rank: int, world: int, impl: str) -> dict[str, Any]:
    """Two windows of three microbatches on a 2 x 2 HSDP mesh; the first two microbatches of
    each with ``set_requires_all_reduce(False)``, then an Adam step."""
    api = engine(impl)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = make(Stack)
    shard_stack(api, model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    counts: list[tuple[int, int]] = []
    grads: list[dict[str, Any]] = []
    for step in range(2):
        for micro in range(3):
            model.set_requires_all_reduce(micro == 2)  # type: ignore[operator]
            with counting() as seen:
                model(data(rank, step=3 * step + micro)).sum().backward()
            counts.append((seen.get(REDUCE_SCATTER, 0), seen.get(ALL_REDUCE, 0)))
            if micro < 2:  # the sharded gradients are untouched until the all-reduce
                assert all(p.grad is None for p in model.parameters())
        grads.append(full_grads(model))
        optim.step()
        optim.zero_grad()
    return {"counts": counts, "grads": grads, "params": full_params(model)}


def test_hsdp_all_reduce_once_per_window_matches_fsdp2() -> None:
    """HSDP with ``set_requires_all_reduce(False)`` on all but the last microbatch: every
    microbatch reduce-scatters, the replica all-reduce runs once per group at the end of the
    window (3 groups: 2 blocks and the root), ``.grad`` is written only then, and gradients and
    trained parameters equal FSDP2's bitwise."""
    ours = run_threaded(_hsdp_window, 4, "ours")
    theirs = run_threaded(_hsdp_window, 4, "fsdp2")
    for mine, control in zip(ours, theirs, strict=True):
        assert [a for _, a in mine["counts"]] == [0, 0, 3] * 2, mine["counts"]
        assert all(rs == 3 for rs, _ in mine["counts"]), mine["counts"]
        assert [a for _, a in control["counts"]] == [0, 0, 3] * 2, control["counts"]
        for got, want in zip(mine["grads"], control["grads"], strict=True):
            for name, value in want.items():
                assert torch.equal(got[name], value), name
        for name, value in control["params"].items():
            assert torch.equal(mine["params"][name], value), name


def _separate_group(rank: int, world: int, impl: str) -> dict[str, Any]:
    """Two steps of a 1-D ``Stack`` with ``set_separate_reduce_scatter_group(True)``: the
    groups every reduce-scatter and all-gather used."""
    api = engine(impl)
    mesh = init_device_mesh("cpu", (world,))
    model = make(Stack)
    shard_stack(api, model, mesh=mesh)
    model.set_separate_reduce_scatter_group(True)  # type: ignore[operator]
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    used: set[int] = set()
    real = dist.reduce_scatter_single

    def record(*args: Any, **kwargs: Any) -> Any:
        used.add(id(kwargs["group"]))
        return real(*args, **kwargs)

    dist.reduce_scatter_single = record
    grads = []
    try:
        for step in range(2):
            model(data(rank, step=step)).sum().backward()
            grads.append(full_grads(model))
            optim.step()
            optim.zero_grad()
    finally:
        dist.reduce_scatter_single = real
    shard = mesh.get_group(0)
    groups = [g for g in dist.distributed_c10d._world.pg_map if id(g) in used]
    return {
        "separate": bool(used) and id(shard) not in used,
        "ranks": [dist.get_process_group_ranks(g) for g in groups],
        "grads": grads,
        "params": full_params(model),
    }


def test_separate_reduce_scatter_group_matches_fsdp2() -> None:
    """``set_separate_reduce_scatter_group(True)``: the reduce-scatters run on a process group
    other than the mesh's, over the same ranks (one for the whole call); the values equal
    FSDP2's bitwise."""
    ours = run_threaded(_separate_group, 2, "ours")
    theirs = run_threaded(_separate_group, 2, "fsdp2")
    for mine, control in zip(ours, theirs, strict=True):
        assert mine["separate"] and control["separate"]
        assert mine["ranks"] == [[0, 1]], mine["ranks"]
        for got, want in zip(mine["grads"], control["grads"], strict=True):
            for name, value in want.items():
                assert torch.equal(got[name], value), name
        for name, value in control["params"].items():
            assert torch.equal(mine["params"][name], value), name


class _Branches(nn.Module):
    """``a`` is used, ``b`` never (on any rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


class _NcclAlone:
    """Patched in for the whole test (the ranks are threads): each rank's mesh group looks
    accelerator-only (no CPU backend), and the all-reduces are recorded per rank."""

    shards: ClassVar[dict[int, Any]] = {}
    groups: ClassVar[dict[int, list[Any]]] = {}

    @classmethod
    def install(cls, monkeypatch: pytest.MonkeyPatch) -> None:
        from fsdp_engine._private import presence

        real_has = presence.compat.has_backend_for
        real_all_reduce = dist.all_reduce
        cls.shards, cls.groups = {}, {}

        def has_backend_for(group: Any, device: torch.device) -> bool:
            if group is cls.shards.get(dist.get_rank()):
                return False
            return bool(real_has(group, device))

        def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            assert tensor.device.type == "cpu"
            cls.groups.setdefault(dist.get_rank(), []).append(kwargs.get("group"))
            return real_all_reduce(tensor, *args, **kwargs)

        monkeypatch.setattr(presence.compat, "has_backend_for", has_backend_for)
        monkeypatch.setattr(presence.dist, "all_reduce", all_reduce)


def _presence_off_the_device(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    shard = _NcclAlone.shards[rank] = mesh.get_group(0)
    model = make(_Branches)
    engine("ours").fully_shard(model, mesh=mesh)
    model.set_reduce_scatter_unused_params(False)  # type: ignore[operator]
    present = []
    for step in range(2):
        model(data(rank, step=step)).sum().backward()
        present.append({n: p.grad is not None for n, p in model.named_parameters()})
        model.zero_grad()
    groups = _NcclAlone.groups.get(rank, [])
    return {
        "present": present,
        "groups": len(groups),
        "on_mesh_group": any(g is shard for g in groups),
        "one_host_group": len({id(g) for g in groups}) == 1,
    }


def test_exact_presence_on_an_accelerator_only_group_never_goes_through_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 34: ``set_reduce_scatter_unused_params(False)`` on a group whose backend serves no
    CPU tensors (NCCL alone) sums the used-flags on a gloo group over the same ranks, made once:
    one host all-reduce per backward, no device copy and so no host sync; the unused
    parameters lose their ``.grad`` as on a gloo group."""
    _NcclAlone.install(monkeypatch)
    for result in run_threaded(_presence_off_the_device, 2):
        for present in result["present"]:
            assert present == {"a.weight": True, "a.bias": True, "b.weight": False, "b.bias": False}
        assert result["groups"] == 2 and result["one_host_group"], result
        assert not result["on_mesh_group"], result


class _OpCount(TorchDispatchMode):
    """Counts the aten ops that launch work inside the block (per op name); views and other
    metadata-only ops (``view``, ``slice``, ``split``, ``detach``...) launch nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket)
        if not func.is_view and name not in _METADATA_ONLY:
            self.ops[name] = self.ops.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


_METADATA_ONLY = frozenset({"aten.split_with_sizes", "aten.split", "aten.detach"})


_COUNTED: dict[int, dict[str, int]] = {}


def _compact_ops(rank: int, world: int, layers: int) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (world,))
    model = make(lambda: nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))))
    engine("ours").fully_shard(model, mesh=mesh)  # one group
    for i, layer in enumerate(model):
        if i % 2 == 0:
            layer.weight.requires_grad_(False)  # a mixed mask: the compact reduction
    _COUNTED[rank] = {}
    model(data(rank)).sum().backward()
    return dict(_COUNTED[rank])


def test_frozen_parameter_reduction_launches_do_not_grow_with_the_parameters(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 34: the reduction of a group with frozen parameters adds each trainable
    gradient's pieces into the compact input with one foreach op, not one op per parameter and
    piece: the ops it dispatches are the same for 4 and for 16 layers in the group."""
    from fsdp_engine._private.reduce import GradReducer

    real = GradReducer._reduce_compact

    def reduce_compact(self: Any, *args: Any, **kwargs: Any) -> Any:
        counted = _OpCount()
        with counted:  # dispatch modes are per thread: each rank counts its own
            out = real(self, *args, **kwargs)
        mine = _COUNTED[dist.get_rank()]
        for name, n in counted.ops.items():
            mine[name] = mine.get(name, 0) + n
        return out

    monkeypatch.setattr(GradReducer, "_reduce_compact", reduce_compact)
    four = run_threaded(_compact_ops, 2, 4)[0]
    sixteen = run_threaded(_compact_ops, 2, 16)[0]
    # Launches only: ``empty`` / ``empty_strided`` / ``set_`` make tensor objects without a
    # kernel (each ``.grad`` is a tensor over its own slice of the gradient storage, one per
    # parameter, as FSDP2 makes one ``.grad`` per parameter).
    no_kernel = {"aten.empty", "aten.empty_strided", "aten.set_"}
    four = {k: v for k, v in four.items() if k not in no_kernel}
    sixteen = {k: v for k, v in sixteen.items() if k not in no_kernel}
    assert four == sixteen, (four, sixteen)
    assert four.get("aten._foreach_add_", 0) == 1, four
