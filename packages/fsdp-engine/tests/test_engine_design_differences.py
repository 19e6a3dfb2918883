"""Where fsdp_engine differs from FSDP2 by design (the table in the README), pinned.

Each test states FSDP2's behaviour and checks ours. Numeric kind of the value comparisons:
*same arithmetic* (the same full values laid out differently), compared bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import Mlp, data, engine, full_grads, full_params, make
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, init_device_mesh

from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


def _layout(rank: int, world: int) -> dict[str, Any]:
    model = make(lambda: Mlp(dim=10, hidden=40, bias=False))
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine("ours").fully_shard(model)
    out: dict[str, Any] = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        out[name] = (
            tuple(p.placements),
            tuple(p.to_local().shape),
            torch.equal(p.full_tensor(), full[name]),
        )
    model(data(rank, dim=10)).sum().backward()
    out["grads"] = {n: g is not None for n, g in full_grads(model).items()}
    return out


def test_a_local_shard_is_a_flat_range_of_the_planned_buffer() -> None:
    """FSDP2: ``Shard(0)``, each rank holds ``torch.chunk(param, world)[rank]`` (rows x cols).
    Ours: ``RaggedShard``, each rank holds a contiguous 1-D range of the parameter's row-major
    storage, wherever the planner put it in the group's buffer, so a rank may hold an empty
    share of a parameter (here the planner puts each 400-element matrix on one rank)."""
    rank0, rank1 = run_threaded(_layout, 2)
    for name in ("up.weight", "down.weight"):
        (placements, shape0, same0), (_, shape1, same1) = rank0[name], rank1[name]
        assert isinstance(placements[0], RaggedShard) and same0 and same1
        assert len(shape0) == len(shape1) == 1  # flat local tensors
        assert sorted((shape0[0], shape1[0])) == [0, 400], (shape0, shape1)
    assert all(rank0["grads"].values()) and all(rank1["grads"].values())


def _refusals(rank: int, world: int) -> dict[str, str]:
    api = engine("ours")
    out: dict[str, str] = {}

    def capture(name: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        else:
            out[name] = "no error"

    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def ddp_mode() -> None:  # FSDP2's DDP mode: dp_mesh_dims naming replicate dims only
        layer = nn.Linear(4, 4)
        for name, param in list(layer.named_parameters()):
            value = DTensor.from_local(param.detach(), hsdp, [Replicate(), Replicate()])
            layer.register_parameter(name, nn.Parameter(value))
        api.fully_shard(layer, mesh=hsdp, dp_mesh_dims=api.DataParallelMeshDims(replicate="dp"))

    capture("dp_mesh_dims without shard dims", ddp_mode)

    return out


def test_what_fsdp2_supports_and_we_refuse_raises_naming_it() -> None:
    """FSDP2 accepts each of these; fsdp_engine raises NotImplementedError naming the call and
    the reason (see the README's table)."""
    out = run_threaded(_refusals, 4)[0]
    expected = {
        "dp_mesh_dims without shard dims": "without shard dims",
    }
    for name, fragment in expected.items():
        assert out[name].startswith("NotImplementedError") and fragment in out[name], out[name]


def _dtypes(rank: int, world: int, impl: str) -> str:
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4).to(torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x).double() + self.b(x.double())

    model = make(Two)
    engine(impl).fully_shard(model)
    try:
        model(torch.randn(2, 4)).sum().backward()
    except Exception as exc:
        return type(exc).__name__
    return "trained"


def test_trainable_parameters_of_several_dtypes_in_one_call() -> None:
    """FSDP2 asserts one dtype for a call's trainable parameters; fsdp_engine makes one group
    (one collective each way) per dtype."""
    assert run_threaded(_dtypes, 2, "fsdp2")[0] == "AssertionError"
    assert run_threaded(_dtypes, 2, "ours")[0] == "trained"


@pytest.mark.parametrize("keep", [True, False])
def test_conditional_compute_never_mismatches_collectives(keep: bool) -> None:
    """FSDP2 reduces only the parameters with a gradient on this rank, so ranks that use
    different parameters issue reduce-scatters of different sizes (gloo aborts); fsdp_engine
    reduces every trainable parameter, zeros where unused (the gloo proof with values is
    test_engine_conditional.py)."""

    def body(rank: int, world: int) -> dict[str, bool]:
        class Branchy(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(4, 4)
                self.b = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.b(self.a(x)) if rank == 0 else self.a(x)

        model = make(Branchy)
        engine("ours").fully_shard(model)
        model.set_reduce_scatter_unused_params(keep)  # type: ignore[operator]
        model(torch.randn(2, 4)).sum().backward()
        return {n: p.grad is not None for n, p in model.named_parameters()}

    presence = run_threaded(body, 2)
    assert presence[0] == presence[1] and all(presence[0].values()), presence


def _frozen_differs(rank: int, world: int, impl: str) -> str:
    """A frozen parameter whose values differ across ranks at ``fully_shard`` (e.g. made with
    ``torch.empty``, or loaded from different files), next to a trainable one."""

    class Frozen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = nn.Parameter(torch.full((4, 4), float(rank)), requires_grad=False)
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.table[:1]

    model = make(Frozen)
    try:
        engine(impl).fully_shard(model)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


def test_frozen_values_that_differ_across_ranks_raise() -> None:
    """FSDP2 shards each rank's own copy, so the frozen parameter silently mixes the ranks'
    values for good (it is never reduced nor updated); fsdp_engine compares the frozen values'
    digests and raises on every rank naming the parameter and the ranks."""
    assert run_threaded(_frozen_differs, 2, "fsdp2") == ["accepted", "accepted"]
    for outcome in run_threaded(_frozen_differs, 2, "ours"):
        assert outcome.startswith("LayoutMismatchError"), outcome
        assert "value of frozen parameter 'table'" in outcome, outcome
        assert "ranks [0]" in outcome and "ranks [1]" in outcome, outcome


class _TwoOutputs(nn.Module):
    """Two heads; the caller decides whether the loss uses the second one."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.relu(self.first(x)), torch.relu(self.second(x))


def _unused_output(rank: int, world: int, impl: str, keep: bool | None) -> Any:
    """Adam over a model whose second output the loss stops using after three steps, with
    ``zero_grad`` alternating ``set_to_none=False/True``; returns the second head's ``.grad``
    presence after each backward and the final full parameters."""
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(_TwoOutputs)
    api.fully_shard(model.first)
    api.fully_shard(model)
    if keep is not None:
        model.set_reduce_scatter_unused_params(keep)  # type: ignore[operator]
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    presence = []
    for step in range(6):
        out1, out2 = model(data(rank, step))
        (out1 * out2 if step < 3 else out1).sum().backward()
        presence.append(model.second.weight.grad is not None)
        optim.step()
        optim.zero_grad(set_to_none=bool(step % 2))
    return presence, full_params(model)


def test_an_unused_forward_output_keeps_a_zero_gradient_unless_asked() -> None:
    """FSDP2's ``test_unused_forward_output`` behaviour: a head no rank uses after step 2
    keeps the ``.grad`` it had before backward (a zero after ``zero_grad(set_to_none=False)``)
    and otherwise has none, so Adam stops moving it. fsdp_engine cannot tell "no rank used
    it" from "another rank did" without communication (README, design differences), so by
    default it keeps a zero ``.grad`` on every rank and Adam keeps moving the head on its
    momentum; ``set_reduce_scatter_unused_params(False)`` gives FSDP2's trajectory (one small
    all-reduce per backward). Same arithmetic (ws 2: a two-term sum and a power-of-two
    scale, Adam on the same values, one thread), compared bitwise."""
    theirs = run_threaded(_unused_output, 2, "fsdp2", None)
    exact = run_threaded(_unused_output, 2, "ours", False)
    kept = run_threaded(_unused_output, 2, "ours", None)
    # FSDP2: present while used (steps 0-2), kept zero at step 3 (zeroed, not dropped, after
    # step 2), then None for good
    assert theirs[0][0] == [True, True, True, True, False, False], theirs[0][0]
    for rank in range(2):
        assert exact[rank][0] == theirs[rank][0]
        for name, value in theirs[rank][1].items():
            assert torch.equal(exact[rank][1][name], value), name
        assert kept[rank][0] == [True] * 6
        for name, value in theirs[rank][1].items():
            same = torch.equal(kept[rank][1][name], value)
            assert same == name.startswith("first."), name


def _float8(rank: int, world: int) -> list[str]:
    class Quantized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            codes = torch.randn(64, 8, generator=gen).to(torch.float8_e4m3fn)
            self.codes = nn.Parameter(codes, requires_grad=False)
            self.lin = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.codes[:2].float()

    model = Quantized()
    full = model.codes.detach().clone()
    engine("ours").fully_shard(model)
    model(torch.randn(2, 8)).sum().backward()
    model.unshard()  # type: ignore[operator]
    same = torch.equal(model.codes.view(torch.uint8), full.view(torch.uint8))
    return [str(model.codes.dtype), str(same)]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_float8_parameters_travel_as_bytes_on_gloo() -> None:
    """gloo has no float8 collectives: a float8 group's buffer is the same bytes as uint8
    ([Note: bit-cast storage]); the parameters keep their dtype and exact bits. Slow (one gloo
    launch, ~20 s): run with ``-m slow``."""
    from ragged_dtensor.testing import run_processes

    for result in run_processes(_float8, 2, timeout=180):
        assert result == ["torch.float8_e4m3fn", "True"], result
