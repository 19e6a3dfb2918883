"""Frozen, unused and ignored parameters: which are reduced and which get a ``.grad``
(``requires_grad`` changed after fully_shard, parameters no rank used, ``ignored_params``).

Numeric kind of every value comparison here: *same arithmetic*: bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    counting,
    data,
    engine,
    full_params,
    make,
    recording_reduce_scatter,
    sharded_stack_and_reference,
)
from engine_models import batches, build, loss_fn
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_threaded


def _freeze(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, reference, optim, ref_optim = sharded_stack_and_reference()
    before = full_params(model)
    out: dict[str, Any] = {"numels": []}
    for step in range(4):
        frozen = step < 3  # freeze the weights (train biases only) after fully_shard, then thaw
        for m in (model, reference):
            for name, p in m.named_parameters():
                p.requires_grad_(not (frozen and name.endswith("weight")))
        with recording_reduce_scatter() as seen:
            model(data(rank, step)).sum().backward()
        out["numels"].append([n for n, _ in seen])
        for name, p in model.named_parameters():
            assert (p.grad is None) == (frozen and name.endswith("weight")), (step, name)
        # one process: the mean of the per-rank-slice gradients
        ref_optim.zero_grad(set_to_none=True)
        for r in range(world):
            reference(data(r, step)).sum().backward()
        for p in reference.parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / world)
        optim.step()
        ref_optim.step()
        optim.zero_grad(set_to_none=True)
        if step == 2:
            after = full_params(model)
            out["frozen_unchanged"] = all(
                torch.equal(after[n], before[n]) for n in before if n.endswith("weight")
            )
    out["params"] = full_params(model)
    out["reference"] = {n: p.detach().clone() for n, p in reference.named_parameters()}
    return out


@pytest.mark.numerics
def test_requires_grad_changes_after_fully_shard_are_respected() -> None:
    """Freezing after fully_shard takes effect at the next forward: frozen parameters get no
    gradient, are not in the reduction (which moves only the trainable elements: one
    reduce-scatter per group, smaller) and are not stepped; unfreezing brings them back. The
    parameters track one process bitwise (per-slice gradients summed: two terms, times 1/2)."""
    results = run_threaded(_freeze, 2)
    for result in results:
        assert result["frozen_unchanged"]
        # (the patch sees both threads' calls: 3 groups x 2 ranks)
        frozen, thawed = result["numels"][0], result["numels"][3]
        assert len(frozen) == len(thawed) == 6, result["numels"]
        assert sum(frozen) < sum(thawed) / 4, result["numels"]
        for name, value in result["reference"].items():
            assert torch.equal(result["params"][name], value), name


def _unused(rank: int, world: int, keep: bool | None) -> Any:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used = nn.Linear(8, 8)
            self.unused = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.used(x)

    model = make(Two)
    engine("ours").fully_shard(model)
    if keep is not None:
        model.set_reduce_scatter_unused_params(keep)  # type: ignore[operator]
    with counting() as counts:
        model(data(rank)).sum().backward()
    zeros = all(
        bool((p.grad.to_local() == 0).all())
        for n, p in model.named_parameters()
        if n.startswith("unused") and p.grad is not None
    )
    return {n: p.grad is not None for n, p in model.named_parameters()}, dict(counts), zeros


@pytest.mark.numerics
def test_parameters_no_rank_used_keep_a_zero_gradient_unless_asked() -> None:
    """The reduction always covers every trainable parameter (a rank that did not use one sends
    zeros, so fsdp_engine never hangs on conditional compute). By default every trainable
    parameter then keeps a ``.grad`` (zeros if no rank used it: the same presence on every
    rank by construction, FSDP2's ``set_reduce_scatter_unused_params(True)``);
    ``set_reduce_scatter_unused_params(False)`` gives one process's presence (None for
    parameters no rank used) for one small all-reduce per backward."""
    for keep in (None, True):
        presence, counts, zeros = run_threaded(_unused, 2, keep)[0]
        assert all(presence.values()) and zeros, presence
        assert "all_reduce" not in counts, counts
    presence, counts, _ = run_threaded(_unused, 2, False)[0]
    assert presence == {
        "used.weight": True,
        "used.bias": True,
        "unused.weight": False,
        "unused.bias": False,
    }
    assert counts.get("all_reduce") == 1, counts


def _ignored(rank: int, world: int) -> bool:
    mesh = init_device_mesh("cpu", (world,))
    model = build()
    fully_shard(model, mesh=mesh, ignored_params={model.head.bias})
    assert not isinstance(model.head.bias, DTensor)
    assert isinstance(model.head.weight, DTensor)
    loss_fn(model, batches(1, world)[0].chunk(world)[rank]).backward()
    return model.head.bias.grad is not None


def test_ignored_params_stay_plain() -> None:
    assert all(run_threaded(_ignored, 2, timeout=60))
