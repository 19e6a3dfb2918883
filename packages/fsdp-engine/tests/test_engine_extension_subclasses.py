"""Every wrapper subclass FSDP2 gathers through the all-gather extension trains like FSDP2:
several inner tensors, any ``__tensor_unflatten__`` form, metadata passed through, hooks patched
onto the class or onto the local tensor after ``fully_shard``.

The control is torch's FSDP2 run on the same ranks with the same data. Numerics: both engines
hand the hooks the same local chunks (FSDP2's padded ``Shard(0)`` chunk of the subclass, made by
its own ops), gather the same bytes and rebuild the same tensors, so losses and every rank's
local parameter tensors (each inner tensor) are compared bitwise, with how often each hook ran.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_fsdp2 import ALL_GATHER, counting, engine, make
from engine_subclass_more import (
    CALLS,
    Bf16Gathered,
    TwoTensor,
    cast_post,
    cast_pre,
    patch_two_tensor,
    unpatch_two_tensor,
)
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from dbuffer import LayoutMismatchError
from ragged_dtensor.testing import count_collectives, run_threaded

pytestmark = pytest.mark.numerics


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _two_tensor_model() -> nn.Module:
    """Three MLP blocks without biases whose weights are ``TwoTensor(w, w.clone())`` (a bias
    would get a ``TwoTensor`` gradient from autograd and a plain one from the reduction, on
    FSDP2 as on us)."""
    model = nn.Sequential(*(Mlp(8, 12, False) for _ in range(3)))
    for block in model:
        for layer in (block.up, block.down):
            w = layer.weight.detach()
            layer.weight = nn.Parameter(TwoTensor(w.clone(), w.clone()))
    return model


def _values(tensor: torch.Tensor) -> list[torch.Tensor]:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    if isinstance(local, TwoTensor):
        return [local.a.detach().clone(), local.b.detach().clone()]
    if isinstance(local, Bf16Gathered):
        return [local._data.detach().clone()]
    return [local.detach().clone()]


def _scalar(loss: torch.Tensor) -> list[float]:
    return [float(t) for t in _values(loss)]


def _sync_patch(rank: int, fn: Any) -> None:
    """Patch a class once (rank 0) while every rank waits (threads share the class)."""
    dist.barrier()
    if rank == 0:
        fn()
    dist.barrier()


def _two_tensor_run(
    rank: int, world: int, impl: str, form: int, hsdp: bool, bf16: bool, reshard: bool
) -> dict[str, Any]:
    api = engine(impl)
    model = make(_two_tensor_model)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard}
    if bf16:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in model:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)
    _sync_patch(rank, lambda: patch_two_tensor(form))  # after fully_shard, before forward
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses, gathers = [], []
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank + 1))
    for step in range(4):
        with counting() as counts:
            loss = model(x).sum()
            loss.backward()
        gathers.append(counts.get(ALL_GATHER, 0))
        losses.append(_scalar(loss))
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)
    first = model[0].up.weight
    assert isinstance(first, DTensor)
    return {
        "losses": losses,
        "params": {n: _values(p) for n, p in model.named_parameters()},
        "local": type(first.to_local()).__name__,
        "placement": first.placements[-1],
        "gathers": gathers[1:],  # the first step also checks agreements (ours)
    }


def _compare(run: Any, world: int, *args: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    calls: dict[str, dict[str, int]] = {}
    for impl in ("fsdp2", "ours"):
        CALLS.clear()
        try:
            out[impl] = run_threaded(run, world, impl, *args, timeout=300)
        finally:
            unpatch_two_tensor()
        calls[impl] = dict(CALLS)
    assert calls["ours"] == calls["fsdp2"], calls
    for ours, theirs in zip(out["ours"], out["fsdp2"], strict=True):
        assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
        for name, values in theirs["params"].items():
            for mine, their in zip(ours["params"][name], values, strict=True):
                assert torch.equal(mine, their), name
        for key in set(theirs) - {"losses", "params", "bytes"}:
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    return {"calls": calls["ours"], **out}


@pytest.mark.parametrize(
    ("world", "form", "hsdp", "bf16", "reshard"),
    [
        (2, 1, False, False, True),
        (2, 5, False, True, False),
        (4, 5, True, False, True),
        (4, 1, True, True, True),
    ],
    ids=["fsdp-fp32-v1", "fsdp-bf16-v5-keep", "hsdp-fp32-v5", "hsdp-bf16-v1"],
)
def test_two_tensor_with_hooks_trains_bitwise_like_fsdp2(
    world: int, form: int, hsdp: bool, bf16: bool, reshard: bool
) -> None:
    """``TwoTensor`` weights (two inner tensors of the parameter's shape: no one tensor holds
    the values) keep their class on the local tensor, FSDP2's padded ``Shard(0)`` chunk; the
    hooks, patched onto the class after ``fully_shard``, gather both inner tensors (in the
    older one-argument form or FSDP2's five-argument form with metadata, handed back to the
    post-hook as given), the pre-hook gets the shard mesh (HSDP: 1-D, the shard axis), the first
    all-gather calls the post-hook without ``out``, the later ones with ``out=`` (aliasing the
    outputs without a cast, refilled with one). Four steps of Adam: everything equals FSDP2's."""
    result = _compare(_two_tensor_run, world, form, hsdp, bf16, reshard)
    calls = result["calls"]
    pre = calls["pre_one" if form == 1 else "pre_five"]
    shard = 2 if hsdp else world
    assert pre > 0 and calls[f"mesh_ndim_1_size_{shard}"] == pre, calls
    assert calls["post"] == 6 * world and calls["post_out"] > 0, calls
    assert result["ours"][0]["local"] == "TwoTensor"
    assert result["ours"][0]["placement"] == Shard(0)


def _bf16_run(rank: int, world: int, impl: str) -> dict[str, Any]:
    api = engine(impl)
    model = make(lambda: Mlp(3, 9, True))  # 3 and 9 rows over 2 ranks: uneven chunks

    def wrap() -> None:
        for layer in (model.up, model.down):
            layer.weight = nn.Parameter(Bf16Gathered(layer.weight.detach().clone()))

    wrap()
    api.fully_shard(model, mesh=init_device_mesh("cpu", (world,)), reshard_after_forward=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    for step in range(3):
        x = torch.randn(2, 3, generator=torch.Generator().manual_seed(10 * step + rank))
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_scalar(loss))
    weight = model.up.weight
    assert isinstance(weight, DTensor)
    return {
        "losses": losses,
        "params": {n: _values(p) for n, p in model.named_parameters()},
        "local": type(weight.to_local()).__name__,
        "shape": tuple(weight.to_local().shape),
    }


def test_three_argument_unflatten_subclass_gathers_in_bf16_like_fsdp2() -> None:
    """A subclass whose ``__tensor_unflatten__`` has the older ``(inner_tensors, outer_size,
    outer_stride)`` form and returns the plain inner tensor (FSDP2 never calls it) is kept on
    the local tensor as FSDP2 keeps it, its pre-hook pads the uneven chunk to the padded size
    itself, the weights travel in bf16 and are upcast after: losses, each rank's local values
    and shapes, and the hooks' calls equal FSDP2's."""
    result = _compare(_bf16_run, 2)
    calls = result["calls"]
    assert calls["bf16_pre"] > 0 and calls["bf16_post"] == 4, calls
    assert result["ours"][0]["local"] == "Bf16Gathered"
    assert result["ours"][1]["shape"] == (4, 3)  # rank 1's short chunk of the 9 rows


def _fill(param: DTensor, rank: int, world: int, seed: int) -> None:
    """Deterministic values: rank's ``torch.chunk`` of a fixed full tensor (both engines)."""
    full = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
    chunks = torch.chunk(full, world)
    local = param.to_local()
    rows = local.shape[0]
    if rows:
        with torch.no_grad():
            local.copy_(chunks[rank][:rows])


def _instance_run(
    rank: int, world: int, impl: str, bf16: bool, on: str = "instance"
) -> dict[str, Any]:
    api = engine(impl)
    with torch.device("meta"):
        model = _two_tensor_model()
    policy = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else None
    mesh = init_device_mesh("cpu", (world,))
    for block in model:
        api.fully_shard(block, mesh=mesh, mp_policy=policy or api.MixedPrecisionPolicy())
    api.fully_shard(model, mesh=mesh, mp_policy=policy or api.MixedPrecisionPolicy())
    model.to_empty(device="cpu")
    patched = 0
    for seed, (name, param) in enumerate(model.named_parameters()):
        assert isinstance(param, DTensor)
        _fill(param, rank, world, seed)
        if on == "instance":  # after to_empty (it replaces the local tensors): on the object
            local = param._local_tensor
            local.fsdp_pre_all_gather = cast_pre.__get__(local)  # type: ignore[attr-defined]
            local.fsdp_post_all_gather = cast_post.__get__(local)  # type: ignore[attr-defined]
            patched += "weight" in name
    if on == "class":
        _sync_patch(rank, lambda: patch_two_tensor(1))
        patched = 6
    assert patched == 6
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    losses = []
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(rank + 1))
    for _ in range(3):
        loss = model(x).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_scalar(loss))
    return {"losses": losses, "params": {n: _values(p) for n, p in model.named_parameters()}}


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_hooks_patched_onto_the_local_tensor_after_to_empty_are_used(bf16: bool) -> None:
    """Meta-device construction, ``fully_shard``, ``to_empty``, values written, then the hooks
    patched onto each weight's local tensor object (not its class): both engines call them at
    every all-gather (the values travel in bf16) and train alike."""
    result = _compare(_instance_run, 2, bf16)
    calls = result["calls"]
    assert calls["instance_pre"] > 0 and calls["instance_post"] == 12, calls


def test_meta_initialized_two_tensor_model_with_class_hooks_trains_like_fsdp2() -> None:
    """Meta-device construction, ``fully_shard`` per block and root with bf16 compute,
    ``to_empty``, values written, the hooks patched onto ``TwoTensor``: three steps of Adam
    equal FSDP2's bitwise (the post-hook refills ``out=`` with a cast)."""
    result = _compare(_instance_run, 2, True, "class")
    calls = result["calls"]
    assert calls["pre_one"] > 0 and calls["post"] == 12 and calls["post_out"] > 0, calls


def _frozen_differ(rank: int, world: int) -> str:
    api = engine("ours")
    model = make(_two_tensor_model)
    weight = model[0].up.weight
    weight.requires_grad_(False)
    if rank == 1:
        with torch.no_grad():
            weight.b.add_(1.0)  # only the second inner tensor differs
    try:
        api.fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    except LayoutMismatchError as exc:
        return str(exc)
    return "no error"


def test_frozen_subclass_parameters_whose_inner_tensors_differ_across_ranks_raise() -> None:
    """A frozen parameter is never updated, so a difference at sharding time stays forever:
    every inner tensor's bytes are compared across ranks, and every rank raises, naming it."""
    for message in run_threaded(_frozen_differ, 2):
        assert "frozen parameter '0.up.weight'" in message, message


def test_unsharded_two_tensor_matches_the_module_without_fsdp() -> None:
    """The gathered ``TwoTensor`` weights rebuild the full parameters: after ``unshard`` the
    registered weights equal the unsharded model's (a single-process reference)."""

    def run(rank: int, world: int) -> list[bool]:
        reference = make(_two_tensor_model)
        model = make(_two_tensor_model)
        api = engine("ours")
        for block in model:
            api.fully_shard(block, mesh=init_device_mesh("cpu", (world,)))
        _sync_patch(rank, lambda: patch_two_tensor(5))
        try:
            for block in model:
                block.unshard()  # type: ignore[operator]
            same = [
                all(torch.equal(x, y) for x, y in zip(_values(p), _values(q), strict=True))
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            ]
            for block in model:
                block.reshard()  # type: ignore[operator]
        finally:
            _sync_patch(rank, unpatch_two_tensor)
        return same

    for same in run_threaded(run, 2):
        assert same and all(same) and math.prod([len(same)]) == 6, same


class _Adapted(nn.Module):
    """A frozen base weight of a subclass with its own storage that gathers in bf16 (the
    three-argument-unflatten one) with trainable plain low-rank adapters in the same group (the
    QLoRA shape, without torchao); 3 and 9 rows are uneven over 2 ranks."""

    def __init__(self, into: int, out: int) -> None:
        super().__init__()
        base = torch.randn(out, into)
        self.weight = nn.Parameter(Bf16Gathered(base), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(3, into) * 0.3)
        self.lora_b = nn.Parameter(torch.randn(out, 3) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _adapted_run(rank: int, world: int, impl: str) -> dict[str, Any]:
    api = engine(impl)
    model = make(lambda: nn.Sequential(_Adapted(8, 9), _Adapted(9, 8)))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses, sent = [], []
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):
        with count_collectives() as counter:
            loss = model(x).sum()
            loss.backward()
        sent.append(dict(counter.bytes))
        opt.step()
        opt.zero_grad()
        losses.append(_scalar(loss))
    return {
        "losses": losses,
        "params": {n: _values(p) for n, p in model.named_parameters()},
        "bytes": sent[1:],
    }


def test_frozen_subclass_weights_with_trainable_adapters_reduce_like_fsdp2() -> None:
    """A group holding a frozen subclass weight and trainable plain adapters (FSDP2's
    ``Shard(0)`` layout for all of them) reduces only the adapters (FSDP2's reduce-scatter
    input: the frozen weights take no bytes): every collective moves no more bytes than
    FSDP2's, and losses and every local tensor equal FSDP2's bitwise."""
    result = _compare(_adapted_run, 2)
    for ours, theirs in zip(result["ours"], result["fsdp2"], strict=True):
        for mine, control in zip(ours["bytes"], theirs["bytes"], strict=True):
            assert set(mine) == set(control), (mine, control)
            assert all(mine[k] <= control[k] for k in mine), (mine, control)


def _tp_subclass(rank: int, world: int, impl: str) -> str:
    from engine_subclass import ScaledWeight

    api = engine(impl)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    layer = make(lambda: nn.Linear(8, 12, bias=False))
    local = torch.chunk(layer.weight.detach(), 2)[mesh["tp"].get_local_rank()].clone()
    tp = DTensor.from_local(ScaledWeight(local), mesh["tp"], [Shard(0)], run_check=False)
    layer.weight = nn.Parameter(tp)
    try:
        api.fully_shard(layer, mesh=mesh["dp"])
    except NotImplementedError as exc:
        return str(exc)
    return type(layer.weight.to_local()).__name__  # type: ignore[operator]


def test_a_tensor_parallel_parameter_whose_local_tensor_is_a_subclass_is_refused_by_name() -> None:
    """float8 with tensor parallelism's shape (a TP DTensor whose local tensor is a subclass
    with the extension): FSDP2 shards it (its local tensor stays the subclass); we refuse it at
    ``fully_shard`` naming the parameter (README contract table: why)."""
    theirs = run_threaded(_tp_subclass, 4, "fsdp2")
    ours = run_threaded(_tp_subclass, 4, "ours")
    assert theirs == ["ScaledWeight"] * 4, theirs
    for message in ours:
        assert "parameter 'weight' is a DTensor (tensor parallel)" in message, message
        assert "ScaledWeight" in message, message
