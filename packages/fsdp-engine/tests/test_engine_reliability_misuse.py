"""Misuses FSDP2 leaves silent, named (issue 28 item 2), each beside FSDP2's behaviour:

- an optimizer built before ``fully_shard`` holds the replaced parameters and trains nothing:
  ``ReplacedParameterWarning`` at its first step, naming the first such parameter;
- ranks running different numbers of no-sync microbatches per step: in the collective debug
  mode, ``CollectiveMismatchError`` naming the microbatch on every rank, within seconds;
- a NaN gradient on one rank: ``set_check_finite_gradients(True)`` raises
  ``NonFiniteGradientError`` on every rank naming the rank and the first parameter.

- ``fully_shard`` records its block policy on the sharded parameters (``param.block_policy``), so
  that AdamW8bit refuses settings that disagree with it at construction, naming both values
  (optim-blockwise's ``test_optim_block_policy_agreement.py``, and the root
  ``tests/test_reliability_optim_checkpoint.py`` on the engine).
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_fsdp2 import engine
from torch import nn
from torch.distributed.tensor import DTensor, Shard, init_device_mesh

from fsdp_engine import NonFiniteGradientError, ReplacedParameterWarning, fully_shard
from ragged_dtensor import collective_checks
from ragged_dtensor.testing import run_processes, run_threaded

DEADLINE_S = 30.0


def _model(name: str, world: int, *, reshard: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    shard = engine(name).fully_shard
    for layer in (model[0], model[2]):
        shard(layer, mesh=mesh, reshard_after_forward=reshard)
    shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


# -- an optimizer holding the parameters fully_shard replaced ---------------------------------


def _same(values: list[torch.Tensor], model: nn.Module) -> bool:
    return all(torch.equal(v, _local(p)) for v, p in zip(values, model.parameters(), strict=True))


_OPTIMIZERS: dict[str, Any] = {
    "SGD": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=0.1),
    "AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=0.1, fused=True),
}


def _stale_optimizer(rank: int, world: int, name: str, kind: str = "SGD") -> dict[str, Any]:
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    originals = list(model.parameters())
    stale = _OPTIMIZERS[kind](model.parameters())  # built before fully_shard
    shard = engine(name).fully_shard
    for layer in (model[0], model[2]):
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    before = [_local(p).clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            model(torch.randn(4, 8)).sum().backward()
            stale.step()
            stale.zero_grad()
    ours = [w for w in seen if issubclass(w.category, ReplacedParameterWarning)]
    unchanged = _same(before, model)
    # an optimizer built after fully_shard: no warning, and it trains
    fresh = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        model(torch.randn(4, 8)).sum().backward()
        fresh.step()
    return {
        "trained": not unchanged,
        "warnings": [(str(w.message), w.filename, w.lineno) for w in ours],
        "later": [str(w.message) for w in later if w.category is ReplacedParameterWarning],
        "trains_after": not _same(before, model),
        "plain_again": all(type(p) is nn.Parameter for p in originals),
    }


def _stale_optimizers(rank: int, world: int) -> dict[str, dict[str, Any]]:
    runs = {"fsdp2": _stale_optimizer(rank, world, "fsdp2")}
    for kind in _OPTIMIZERS:
        runs[f"ours, {kind}"] = _stale_optimizer(rank, world, "ours", kind)
    return runs


@pytest.mark.multiprocess
def test_an_optimizer_built_before_fully_shard_is_named_at_its_first_step() -> None:
    """FSDP2 (control): the optimizer steps the replaced parameters, nothing trains, nothing is
    said. Ours: one ReplacedParameterWarning at the first ``step()`` line, naming the first
    parameter, on every rank; no cost on later steps (the old parameters are plain again), and
    an optimizer built after ``fully_shard`` trains without a warning. Any optimizer: SGD,
    AdamW foreach and fused (all read ``.grad`` first; optim-blockwise's optimizers too)."""
    for by_engine in run_processes(_stale_optimizers, 2, timeout=120):
        for name, result in by_engine.items():
            assert not result["trained"] and result["trains_after"], (name, result)
            assert result["later"] == [], (name, result)
            if name == "fsdp2":
                assert result["warnings"] == [], result
                continue
            assert result["plain_again"]
            [(message, filename, lineno)] = result["warnings"]
            assert "parameter '0.weight'" in message and "fully_shard replaced" in message
            assert "Build the optimizer after fully_shard" in message
            assert filename == __file__  # the stale.step() line, not torch's internals
            line = Path(__file__).read_text().splitlines()[lineno - 1]
            assert "stale.step()" in line, line


# -- microbatch counts that differ across ranks ------------------------------------------------


def _microbatches(rank: int, world: int, case: str) -> tuple[str, float]:
    """Rank 0 runs 2 microbatches per step, rank 1 runs 3; ``late``: the flag is set between
    forward and backward; ``kept``: parameters kept unsharded through the window (no collective
    in a no-sync microbatch); ``same``: every rank runs 2 (the control)."""
    model = _model("ours", world, reshard=case != "kept")
    if case == "kept":
        model.set_reshard_after_backward(False)
    micro = 2 if rank == 0 or case == "same" else 3
    start = time.monotonic()
    try:
        with collective_checks():
            for _ in range(2):
                for k in range(micro):
                    last = k == micro - 1
                    if case != "late":
                        model.set_requires_gradient_sync(last)
                    loss = model(torch.randn(4, 8)).sum()
                    if case == "late":
                        model.set_requires_gradient_sync(last)
                    loss.backward()
        outcome = "no error"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    return outcome, time.monotonic() - start


def _microbatch_cases(rank: int, world: int, cases: list[str]) -> dict[str, tuple[str, float]]:
    store = dist.distributed_c10d._get_default_store()
    outcomes = {}
    for index, case in enumerate(cases):
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore(f"case-{index}", store),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=120),
        )
        outcomes[case] = _microbatches(rank, world, case)
    return outcomes


@pytest.mark.multiprocess
def test_microbatch_counts_that_differ_across_ranks_are_named_in_debug_mode() -> None:
    """FSDP2 (and ours without the debug mode): the collectives no longer pair and gloo waits
    for its timeout (30 min); with parameters kept unsharded the reductions pair and rank 1's
    gradient silently sums 3 microbatches. In the collective debug mode every rank raises
    CollectiveMismatchError at the first microbatch where the ranks differ, before any of its
    collectives, naming the microbatch and each side's requires_gradient_sync."""
    cases = ["default", "kept", "late", "same"]
    results = run_processes(_microbatch_cases, 2, cases, timeout=300)
    for rank, outcomes in enumerate(results):
        outcome, seconds = outcomes["same"]
        assert outcome == "no error", (rank, outcome)
        for case in ("default", "kept", "late"):
            outcome, seconds = outcomes[case]
            phase = "backward" if case == "late" else "forward"
            assert outcome.startswith(
                "CollectiveMismatchError: fsdp_engine: the ranks run different numbers of "
                "microbatches per gradient synchronization (at the start of the "
                f"{phase} of microbatch 2 of accumulation window 1 on this rank)"
            ), (case, rank, outcome)
            assert "requires_gradient_sync: ranks [0] have 'True', ranks [1] have 'False'" in (
                outcome
            )
            assert seconds < DEADLINE_S, (case, rank, seconds)


# -- a non-finite gradient on one rank ---------------------------------------------------------


def _nan_on_rank_1(
    rank: int, world: int, name: str, check: bool, in_place: bool = False
) -> dict[str, Any]:
    model = _model(name, world)
    if check:
        model.set_check_finite_gradients(True)  # type: ignore[operator]
    if in_place:  # the reduction reads the parameters' storage ([Note: gradients in ...])
        model.set_gradients_in_parameter_storage(True)  # type: ignore[operator]
    inputs = [torch.randn(4, 8, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    poisoned = {"on": rank == 1}  # rank 1's gradient of the second layer's weight, steps 0-1
    registered: list[bool] = []

    def poison(module: nn.Module, args: Any) -> None:
        if not registered:  # once: the unsharded parameter lives across steps
            registered.append(True)
            module.weight.register_hook(
                lambda g: torch.full_like(g, float("nan")) if poisoned["on"] else g
            )

    model[2].register_forward_pre_hook(poison)
    grads: list[list[torch.Tensor]] = []
    errors: list[str] = []
    for step, x in enumerate(inputs):
        try:
            model(x).sum().backward()
            errors.append("")
        except NonFiniteGradientError as exc:
            errors.append(str(exc))
        grads.append([_local(p.grad).clone() for p in model.parameters()])  # type: ignore[arg-type]
        for p in model.parameters():
            p.grad = None
        poisoned["on"] = poisoned["on"] and step < 1
    finite = [all(bool(torch.isfinite(g).all()) for g in step) for step in grads]
    return {"errors": errors, "finite": finite, "grads": grads}


def _nan_runs(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {
        "fsdp2": _nan_on_rank_1(rank, world, "fsdp2", False),
        "off": _nan_on_rank_1(rank, world, "ours", False),
        "on": _nan_on_rank_1(rank, world, "ours", True),
        "on, in place": _nan_on_rank_1(rank, world, "ours", True, in_place=True),
    }


@pytest.mark.multiprocess
def test_a_nan_gradient_on_one_rank_is_named_with_its_rank_and_first_parameter() -> None:
    """FSDP2 (control) and ours by default: rank 1's NaN reaches every rank's gradients
    silently. ``set_check_finite_gradients(True)``: ``backward()`` raises
    NonFiniteGradientError on every rank, naming rank 1, its module and '2.weight' (also with
    gradients in the parameters' storage); the engine is ready for the next step; finite steps
    give the same gradients as without the check."""
    for rank, runs in enumerate(run_processes(_nan_runs, 2, timeout=180)):
        for name in ("fsdp2", "off"):
            result = runs[name]
            assert result["errors"] == ["", "", ""], (name, result["errors"])
            assert result["finite"] == [False, False, True], (name, rank, result["finite"])
        plain = runs["off"]
        for checked in (runs["on"], runs["on, in place"]):
            assert checked["errors"][2] == "" and checked["finite"][2]
            for step in (0, 1):
                error = checked["errors"][step]
                assert error.startswith(
                    "fsdp_engine: non-finite gradient norm before the reduction on rank 1 "
                    "(rank 1: norm nan in the fully_shard module '2' (FSDPLinear))"
                ), (rank, error)
                assert "First parameter with a non-finite gradient: '2.weight'" in error
            for a, b in zip(plain["grads"][2], checked["grads"][2], strict=True):
                assert torch.equal(a, b)  # the check changes nothing it sees


def _inf_input_on_rank_2_hsdp(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_check_finite_gradients(True)  # type: ignore[operator]
    x = torch.randn(4, 8)
    if rank == 2:  # replica 1, shard 0
        x[0, 0] = float("inf")
    try:
        model(x).sum().backward()
    except NonFiniteGradientError as exc:
        return str(exc)
    return "no error"


def test_a_non_finite_gradient_is_named_across_both_axes_of_an_hsdp_mesh() -> None:
    """HSDP 2x2 (threaded): rank 2's inf input is named on all four ranks, with both of its
    groups and the first parameter in the root's order."""
    for message in run_threaded(_inf_input_on_rank_2_hsdp, 4, timeout=120):
        assert message.startswith(
            "fsdp_engine: non-finite gradient norm before the reduction on rank 2 (rank 2: norm "
            "nan in the fully_shard module '0' (FSDPLinear); rank 2: norm inf in the "
            "fully_shard module '2' (FSDPLinear))"
        ), message
        assert "First parameter with a non-finite gradient: '0.weight'" in message


def _poisoned_stack(rank: int, world: int, name: str, targets: list[str]) -> dict[str, Any]:
    """The ``Stack`` model (the root owns ``proj`` and ``out``, so its group's order is not the
    parameters' order) with rank 1's gradients of ``targets`` set to NaN, one backward."""
    from engine_fsdp2 import Stack, data, make, shard_stack

    model: Any = make(Stack)
    shard_stack(engine(name), model, mesh=init_device_mesh("cpu", (world,)))
    if name == "ours":
        model.set_check_finite_gradients(True)
    for target in targets:
        owner, attr = target.rsplit(".", 1)
        hooked: list[bool] = []

        def hook(
            module: nn.Module, args: Any, attr: str = attr, hooked: list[bool] = hooked
        ) -> None:
            if not hooked:  # once: the unsharded parameter lives across the step
                hooked.append(True)
                getattr(module, attr).register_hook(
                    lambda g: torch.full_like(g, float("nan")) if rank == 1 else g
                )

        model.get_submodule(owner).register_forward_pre_hook(hook)
    try:
        model(data(rank)).sum().backward()
    except NonFiniteGradientError as exc:
        return {"error": str(exc)}
    nonfinite = [
        n
        for n, p in model.named_parameters()
        if not bool(torch.isfinite(p.grad.full_tensor()).all())
    ]
    return {"error": "", "nonfinite": nonfinite}


@pytest.mark.parametrize(
    "targets",
    [["out.bias", "blocks.0.up.weight"], ["blocks.1.down.bias"], ["out.weight"]],
    ids=["root-last-and-a-block", "a-later-parameter-of-a-group", "root-owned"],
)
def test_the_first_non_finite_parameter_in_parameter_order_is_named(targets: list[str]) -> None:
    """The named parameter is the first in ``named_parameters()`` order whose reduced gradient
    is non-finite: FSDP2 (control, no check) reduces the same NaNs silently, and its
    non-finite gradients, in parameter order, are the ones the message names."""
    control = run_threaded(_poisoned_stack, 2, "fsdp2", targets)
    expected = control[0]["nonfinite"]
    assert control[1]["nonfinite"] == expected and sorted(expected) == sorted(targets)
    for result in run_threaded(_poisoned_stack, 2, "ours", targets):
        message = result["error"]
        named = f"First parameter with a non-finite gradient: {expected[0]!r}"
        if len(expected) > 1:
            named += f" ({len(expected)} in all: {', '.join(map(repr, expected))})"
        assert f"{named}. Raised on every rank" in message, message


# -- the block policy, recorded on the sharded parameters --------------------------------------


def _blocks_of_4(name: str, param: torch.Tensor) -> int:
    return 4


def _recorded_policy(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(1) if param is model[2].weight else None

    fully_shard(model[2], mesh=mesh, block_policy=_blocks_of_4, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, block_policy=_blocks_of_4)

    def recorded() -> dict[str, Any]:
        return {n: getattr(p, "block_policy", None) for n, p in model.named_parameters()}

    expected = {"0.weight": _blocks_of_4, "0.bias": _blocks_of_4, "2.weight": None}
    expected["2.bias"] = _blocks_of_4
    assert recorded() == expected  # Shard(d)-placed parameters carry none
    model.to(torch.float64)  # _apply: the engine adopts what it left registered
    model(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    assert recorded() == expected
    model[0].weight = nn.Parameter(torch.zeros(16, 8, dtype=torch.float64))  # adopted
    model.state_dict()
    assert recorded() == expected


def test_fully_shard_records_its_block_policy_on_the_sharded_parameters() -> None:
    """``param.block_policy`` (optim-blockwise's AdamW8bit checks it at construction): the policy
    as given, on every planned parameter, kept through ``_apply`` and adoption; none on
    ``Shard(d)``-placed ones."""
    run_threaded(_recorded_policy, 2, timeout=120)
