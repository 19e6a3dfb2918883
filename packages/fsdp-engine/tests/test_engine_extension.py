"""FSDP2's all-gather extension (``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a
parameter's tensor subclass), with torch's FSDP2 as the control.

Numerics: the same arithmetic (the hooks see the same local chunks, gather the same bytes and
rebuild the same tensors), compared bitwise: losses, trained parameters, and how often each
hook ran in which form.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from engine_fsdp2 import ALL_GATHER, counting, data, engine, make
from engine_subclass import (
    CALLS,
    ScaledWeight,
    Tagged,
    tagged_post_all_gather,
    tagged_pre_all_gather,
)
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from dbuffer import LayoutMismatchError
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


class Net(nn.Module):
    """Two linears whose weights are subclass tensors, plain biases, and a plain parameter of
    5 rows (uneven over 2 and 4 ranks: FSDP2's padded chunk) in the root's group."""

    def __init__(self, cls: type[torch.Tensor]) -> None:
        super().__init__()
        self.a = nn.Linear(8, 12)
        self.b = nn.Linear(12, 8)
        self.extra = nn.Parameter(torch.randn(5, 3))
        for layer in (self.a, self.b):
            layer.weight = nn.Parameter(cls(layer.weight.detach().clone()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.relu(self.a(x))) + self.extra.sum()


def _train(
    rank: int, world: int, impl: str, cls: type[torch.Tensor], hsdp: bool, bf16: bool, patch: bool
) -> dict[str, Any]:
    api = engine(impl)
    model = make(lambda: Net(cls))
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,))
    kwargs: dict[str, Any] = {"mesh": mesh}
    if bf16:
        kwargs["mp_policy"] = api.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    api.fully_shard(model.a, **kwargs)
    api.fully_shard(model, **kwargs)
    if patch:  # the hooks arrive on the class after fully_shard, before the first forward
        dist.barrier()
        if rank == 0:
            Tagged.fsdp_pre_all_gather = tagged_pre_all_gather  # type: ignore[attr-defined]
            Tagged.fsdp_post_all_gather = tagged_post_all_gather  # type: ignore[attr-defined]
        dist.barrier()
    seen: list[str] = []
    model.a.register_forward_pre_hook(lambda m, _: seen.append(type(m.weight).__name__))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, gathers = [], []
    for step in range(3):
        with counting() as counts:
            loss = model(data(rank, step)).float().square().mean()
            loss.backward()
        gathers.append(counts.get(ALL_GATHER, 0))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    weight = model.a.weight
    assert isinstance(weight, DTensor)
    return {
        "losses": losses,
        "params": {n: p.full_tensor() for n, p in model.named_parameters()},  # type: ignore[operator]
        "local": type(weight.to_local()).__name__,
        "placement": weight.placements[-1],
        "unsharded": seen[-1],
        "gathers": gathers[1:],  # the first step also checks agreements (ours)
    }


def _both(world: int, *args: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    calls: dict[str, dict[str, int]] = {}
    for impl in ("fsdp2", "ours"):
        CALLS.clear()
        try:
            out[impl] = run_threaded(_train, world, impl, *args, timeout=300)
        finally:
            for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
                if name in vars(Tagged):
                    delattr(Tagged, name)
        calls[impl] = dict(CALLS)
    assert calls["ours"] == calls["fsdp2"], calls
    for ours, theirs in zip(out["ours"], out["fsdp2"], strict=True):
        assert ours["losses"] == theirs["losses"]
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name
        for key in ("local", "placement", "unsharded", "gathers"):
            assert ours[key] == theirs[key], (key, ours[key], theirs[key])
    return {"calls": [calls["ours"]], **out}


@pytest.mark.parametrize(
    ("world", "hsdp", "bf16"), [(2, False, False), (4, True, True)], ids=["fsdp", "hsdp-bf16"]
)
def test_extension_hooks_train_bitwise_like_fsdp2(world: int, hsdp: bool, bf16: bool) -> None:
    """ScaledWeight all-gathers two inputs of other dtypes (bf16 rows scaled by this rank's
    amax, and the amax in fp32) in the group's one all-gather with the plain biases and the
    uneven plain parameter; the pre-hook gets the shard mesh (HSDP: the shard axis), the
    outer size and stride, the module and torch's policy; the first gather calls the post-hook
    without ``out``, every later one with ``out=`` the unsharded parameter. Everything equals
    FSDP2's, including the local tensor's class and placement (the subclass is kept, in FSDP2's
    ``Shard(0)`` layout) and the number of all-gathers per step."""
    result = _both(world, ScaledWeight, hsdp, bf16, False)
    calls = result["calls"][0]
    assert calls["pre"] > 0 and calls["post"] == 2 * world and calls["post_out"] > 0, calls
    assert calls[f"pre_mesh_size_{2 if hsdp else world}"] == calls["pre"], calls
    assert calls["pre_policy_torch"] == calls["pre"], calls
    first = result["ours"][0]
    assert first["local"] == "ScaledWeight" and first["placement"] == Shard(0)
    assert first["unsharded"] == "Parameter"  # what fsdp_post_all_gather returned


def test_hooks_patched_onto_the_class_after_fully_shard_are_used() -> None:
    """A subclass without hooks at ``fully_shard`` gets them patched onto its class before the
    first forward (FSDP2 looks them up at lazy init and at every gather), in FSDP2's older
    one-argument ``fsdp_pre_all_gather(mesh)`` form: both engines call them, alike."""
    result = _both(2, Tagged, False, False, True)
    calls = result["calls"][0]
    assert calls["tagged_pre"] > 0 and calls["tagged_post"] == 4, calls
    assert calls["tagged_post_out"] > 0, calls


class OnlyPre(Tagged):
    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        return (self._data,), None


class ThreeArguments(Tagged):
    def fsdp_pre_all_gather(self, mesh: Any, outer_size: Any, outer_stride: Any) -> Any:
        return (self._data,), None

    def fsdp_post_all_gather(
        self, outputs: Any, metadata: Any, dtype: Any, *, out: Any = None
    ) -> Any:
        return outputs[0], outputs


def _errors(rank: int, world: int, impl: str, cases: tuple[str, ...]) -> dict[str, str]:
    api = engine(impl)
    mesh = init_device_mesh("cpu", (world,))
    out: dict[str, str] = {}
    kinds = {"only one hook": (OnlyPre, 12), "three-argument pre-hook": (ThreeArguments, 12)}
    kinds["uneven rows, unpadded inputs"] = (ScaledWeight, 13)
    for name in cases:
        cls, rows = kinds[name]
        layer = make(lambda rows=rows: nn.Linear(8, rows))  # type: ignore[misc]
        layer.weight = nn.Parameter(cls(layer.weight.detach().clone()))
        try:
            api.fully_shard(layer, mesh=mesh)
            layer(torch.ones(2, 8))
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"
    return out


def test_extension_errors_are_fsdp2s() -> None:
    """Only one hook defined (at ``fully_shard``) and a pre-hook of neither FSDP2 signature (at
    the first all-gather): FSDP2's exception types and messages. An unevenly sharded parameter
    whose inputs are not the padded chunk's size: FSDP2's AssertionError, raised by FSDP2 on the
    ranks holding a short chunk only (the others hang in the all-gather, so FSDP2 cannot be run
    on it here), by us on every rank."""
    same = ("only one hook", "three-argument pre-hook")
    ours = run_threaded(_errors, 2, "ours", (*same, "uneven rows, unpadded inputs"))
    theirs = run_threaded(_errors, 2, "fsdp2", same)[1]
    assert ours[1]["only one hook"].startswith("AssertionError: Both fsdp_pre_all_gather")
    # the message ends with the local tensor's repr (its values: the same chunk)
    assert ours[1]["only one hook"] == theirs["only one hook"]
    assert ours[1]["three-argument pre-hook"] == theirs["three-argument pre-hook"]
    assert ours[1]["three-argument pre-hook"].startswith("AssertionError: Invalid fsdp_pre")
    fsdp2_message = (
        "AssertionError: When a parameter is unevenly sharded by FSDP (orig size=torch.Size("
        "[13, 8]), FSDP world size=2), fsdp_pre_all_gather must return all-gather inputs with "
        "the padded sharded size torch.Size([7, 8]) but got [torch.Size([7, 8]), "
        "torch.Size([1])]"
    )
    assert [o["uneven rows, unpadded inputs"] for o in ours] == [fsdp2_message] * 2


class RankSized(Tagged):
    """Rank 1's pre-hook returns one more element than rank 0's."""

    def fsdp_pre_all_gather(self, mesh: Any) -> Any:
        extra = mesh.get_local_rank()
        return (torch.cat([self._data.reshape(-1), self._data.new_zeros(extra)]),), None

    def fsdp_post_all_gather(
        self, outputs: Any, metadata: Any, dtype: Any, *, out: Any = None
    ) -> Any:
        return outputs[0], outputs


def _disagree(rank: int, world: int) -> str:
    api = engine("ours")
    layer = make(lambda: nn.Linear(8, 12))
    layer.weight = nn.Parameter(RankSized(layer.weight.detach().clone()))
    api.fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    try:
        layer(torch.ones(2, 8))
    except LayoutMismatchError as exc:
        return str(exc)
    return "no error"


def test_ranks_whose_inputs_differ_in_size_all_raise_naming_the_parameter() -> None:
    """FSDP2 relies on every rank's inputs having the same sizes and hangs or aborts when they
    do not; here every rank raises, naming the parameter and the sizes each rank gave."""
    for message in run_threaded(_disagree, 2):
        assert "'weight'" in message and "ranks [0]" in message and "ranks [1]" in message, message
