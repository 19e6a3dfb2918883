"""Gradients in the parameters' storage are never silently wrong: a model that reads an alias
of a weight earlier than the layer's own use (so its backward reads the alias after the
weight's gradient was written over it) raises autograd's in-place error (``w.detach()``, a view
under ``no_grad``), or runs the default hand-over and warns (``w.data``) ([Note: reading an
overwritten weight]).

Numeric kind: the default path and the fall-back run the same arithmetic in the same order:
bitwise against each other. torch's FSDP2 (the control) computes the same fp32 gradients; it
is compared bitwise as well (same kernels, same reduction order on 2 ranks).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_fsdp2 import engine, make
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_engine._private.handover import InPlaceHandover
from ragged_dtensor.testing import run_threaded

DIM = 16


def _alias(weight: torch.Tensor, how: str) -> torch.Tensor:
    if how == "detach":
        return weight.detach()
    if how == "data":
        return weight.data
    if how == "view":
        with torch.no_grad():
            return weight[:, :]
    return weight  # "none": the weight itself, a use autograd knows


class AliasReader(nn.Linear):
    """Reads an alias of its own weight before its own use: in backward, the alias is read
    after the weight's gradient was accumulated."""

    def __init__(self, how: str) -> None:
        super().__init__(DIM, DIM)
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixed = torch.tanh(x @ _alias(self.weight, self.how).t())
        return F.linear(mixed, self.weight, self.bias)


class Model(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(AliasReader(how) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x


def _run(rank: int, world: int, how: str, name: str, in_place: bool) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    model: Any = make(lambda: Model(how))
    api = engine(name)
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    if in_place:
        model.set_gradients_in_parameter_storage(True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[dict[str, torch.Tensor]] = []
    for step in range(2):
        x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(10 * step + rank))
        try:
            model(x).square().mean().backward()
        except RuntimeError as exc:
            return {"error": str(exc)}
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return {"error": "", "grads": grads}


def _runs(*args: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """``_run`` on 2 threaded ranks, and the warnings about the option they gave (recorded
    here: ``catch_warnings`` is process-wide, so not inside the ranks' threads)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = run_threaded(_run, 2, *args)
    option = "set_gradients_in_parameter_storage"
    return results, [str(w.message) for w in caught if option in str(w.message)]


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return all(torch.equal(x[n], y[n]) for x, y in zip(a, b, strict=True) for n in x)


@pytest.mark.parametrize("how", ["detach", "view"])
def test_an_alias_sharing_the_weights_version_raises_instead_of_reading_the_gradient(
    how: str,
) -> None:
    """``w.detach()`` and a ``no_grad`` view share the unsharded weight's version counter: the
    overwrite bumps it and autograd refuses the stale read (its in-place error; for a view made
    under ``no_grad``, its no-grad-view variant). The default path (and FSDP2) train this model
    normally, with the same gradients."""
    default, _ = _runs(how, "ours", False)
    control, _ = _runs(how, "fsdp2", False)
    for ours, fsdp2 in zip(default, control, strict=True):
        assert ours["error"] == "" and fsdp2["error"] == ""
        assert _same(ours["grads"], fsdp2["grads"])
    expected = {
        "detach": "one of the variables needed for gradient computation has been modified by an "
        "inplace operation",
        "view": "is a view of a view which was created in no_grad mode and its base or another "
        "view of its base has been modified inplace",
    }[how]
    in_place, _ = _runs(how, "ours", True)
    for result in in_place:
        assert expected in result["error"], result


def test_a_data_read_falls_back_to_the_default_path_and_warns() -> None:
    """``w.data`` has a version counter of its own: the read is noted instead, and the group
    keeps its gradients beside the parameters: the same gradients as the default path (and as
    FSDP2), and one warning per group and rank naming the parameter."""
    default, quiet = _runs("data", "ours", False)
    control, _ = _runs("data", "fsdp2", False)
    guarded, warned = _runs("data", "ours", True)
    for ours, fsdp2, fallback in zip(default, control, guarded, strict=True):
        assert ours["error"] == fsdp2["error"] == fallback["error"] == ""
        assert _same(ours["grads"], fsdp2["grads"])
        assert _same(ours["grads"], fallback["grads"])
    assert quiet == []
    assert len(warned) == 4, warned  # 2 ranks x 2 groups that read it, once each (2 steps)
    assert all("the model read .data of ['weight'] during forward" in m for m in warned)


def test_the_weights_own_use_keeps_the_in_place_path() -> None:
    """No alias: the in-place path runs (no error, no warning) with the default path's
    gradients: the guard raises no false alarm."""
    default, _ = _runs("none", "ours", False)
    overwrites: list[int] = []
    real = InPlaceHandover._overwrite

    def counted(self: InPlaceHandover, i: int, grad: torch.Tensor) -> None:
        overwrites.append(i)
        real(self, i, grad)

    InPlaceHandover._overwrite = counted  # type: ignore[method-assign]
    try:
        in_place, warned = _runs("none", "ours", True)
    finally:
        InPlaceHandover._overwrite = real  # type: ignore[method-assign]
    assert warned == []
    assert len(overwrites) == 2 * 2 * 3 * 2  # ranks x steps x groups x parameters: armed
    for ours, mine in zip(default, in_place, strict=True):
        assert mine["error"] == ""
        assert _same(ours["grads"], mine["grads"])
