"""Gradients in the parameters' storage (``set_gradients_in_parameter_storage``, opt-in): the
same gradients and training as the default hand-over, bitwise, in every case that arms it or
must not (checkpointed layers of both kinds, a parameter unused on one rank, tied weights,
no-sync microbatches, mixed precision, ``reshard_after_backward=False``), and one layer's
gradients less at the peak of backward."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

import fsdp_engine
from dbuffer.testing import LiveBytes
from fsdp_engine._private.handover import InPlaceHandover
from ragged_dtensor.testing import run_threaded

_BUILD = threading.Lock()  # ranks are threads sharing torch's generator
_LOCAL = threading.local()
DIM = 32


class Block(nn.Module):
    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)
        self.skipped = nn.Linear(DIM, DIM)  # used on rank 0 only
        self.checkpointing = checkpointing

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(F.gelu(self.up(x)))
        if torch.distributed.get_rank() == 0:
            y = y + self.skipped(x)
        return x + y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointing is None:
            return self._body(x)
        return checkpoint(  # type: ignore[no-any-return]
            self._body, x, use_reentrant=self.checkpointing == "reentrant"
        )


class Model(nn.Module):
    def __init__(self, checkpointing: str | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, DIM)
        self.blocks = nn.ModuleList(Block(checkpointing) for _ in range(3))
        self.head = nn.Linear(DIM, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, in the root group

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _train(
    rank: int,
    world: int,
    in_place: bool,
    *,
    checkpointing: str | None = None,
    microbatches: int = 1,
    mp: fsdp_engine.MixedPrecisionPolicy | None = None,
    reshard_after_backward: bool = True,
) -> tuple[list[torch.Tensor], int]:
    """Three AdamW steps; returns every rank's full parameters and gradients after them and how
    many gradients went into the parameters' storage."""
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = Model(checkpointing)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in model.blocks:
        fsdp_engine.fully_shard(block, **kwargs)
    fsdp_engine.fully_shard(model, **kwargs)
    model.set_gradients_in_parameter_storage(in_place)  # type: ignore[operator]
    model.set_reshard_after_backward(reshard_after_backward)  # type: ignore[operator]
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    _LOCAL.overwritten = 0
    for _ in range(3):
        for micro in range(microbatches):
            model.set_requires_gradient_sync(micro == microbatches - 1)  # type: ignore[operator]
            tokens = torch.randint(0, 16, (2, 8), generator=gen)
            model(tokens).float().pow(2).mean().backward()
        for module in model.modules():  # kept unsharded: the sharded parameters hold .grad
            if isinstance(module, fsdp_engine.FSDPModule):
                module.reshard()
        results = [p.grad.full_tensor() for p in model.parameters()]  # type: ignore[union-attr]
        optim.step()
        optim.zero_grad()
    results += [p.full_tensor() for p in model.parameters()]  # type: ignore[attr-defined]
    return results, int(_LOCAL.overwritten)


@pytest.fixture(autouse=True)
def _count_overwrites(monkeypatch: pytest.MonkeyPatch) -> None:
    real: Callable[..., None] = InPlaceHandover._overwrite

    def counted(self: InPlaceHandover, i: int, grad: torch.Tensor) -> None:
        _LOCAL.overwritten = getattr(_LOCAL, "overwritten", 0) + 1
        real(self, i, grad)

    monkeypatch.setattr(InPlaceHandover, "_overwrite", counted)


def _same(a: list[tuple[list[torch.Tensor], int]], b: list[tuple[list[torch.Tensor], int]]) -> None:
    for (ours, _), (ref, _) in zip(a, b, strict=True):
        assert len(ours) == len(ref)
        for x, y in zip(ours, ref, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("checkpointing", [None, "non-reentrant", "reentrant"])
def test_same_training_as_the_default_hand_over(checkpointing: str | None) -> None:
    """Same arithmetic (the reduce-scatter adds the same gradients in the same order): bitwise.
    Every trainable parameter used on the rank goes into the storage: 3 blocks x (4 or 6
    tensors used; the unused ``skipped`` layer is a zero slot on rank 1) + the tied table, per
    step (a reentrant checkpoint's nested backward included: the group's pre-backward runs in
    it too)."""
    ref = run_threaded(functools.partial(_train, checkpointing=checkpointing), 2, False)
    ours = run_threaded(functools.partial(_train, checkpointing=checkpointing), 2, True)
    _same(ours, ref)
    assert [n for _, n in ref] == [0, 0]
    assert [n for _, n in ours] == [3 * (3 * 6 + 1), 3 * (3 * 4 + 1)]


def test_no_sync_microbatches_accumulate_as_before() -> None:
    """A window of microbatches accumulates in the reduce-dtype accumulator, which the reduction
    then reads: no backward of the window writes into the parameters (the last one adds into
    the accumulator too), and the window's sum is the default's."""
    ref = run_threaded(functools.partial(_train, microbatches=3), 2, False)
    ours = run_threaded(functools.partial(_train, microbatches=3), 2, True)
    _same(ours, ref)
    assert [n for _, n in ours] == [0, 0]


@pytest.mark.parametrize(
    "case",
    [
        {"mp": fsdp_engine.MixedPrecisionPolicy(param_dtype=torch.bfloat16)},
        {"reshard_after_backward": False},
    ],
    ids=["mixed-precision", "no-reshard-after-backward"],
)
def test_never_armed_where_it_does_not_apply(case: dict[str, Any]) -> None:
    """A bf16 unsharded storage cannot hold the fp32 reduction's input, and parameters kept
    unsharded after backward must keep their values: the default hand-over, bitwise."""
    ref = run_threaded(functools.partial(_train, **case), 2, False)
    ours = run_threaded(functools.partial(_train, **case), 2, True)
    _same(ours, ref)
    assert [n for _, n in ours] == [0, 0]


def _peak_of_backward(rank: int, world: int, in_place: bool) -> int:
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(
            *(nn.Sequential(*(nn.Linear(128, 128, bias=False) for _ in range(4))) for _ in range(4))
        )
    for layer in model:
        fsdp_engine.fully_shard(layer, mesh=mesh)
    fsdp_engine.fully_shard(model, mesh=mesh)
    model.set_gradients_in_parameter_storage(in_place)  # type: ignore[operator]
    x = torch.randn(1, 128)
    model(x).sum().backward()  # warm-up: lazy init
    model.zero_grad(set_to_none=True)
    loss = model(x).sum()
    with LiveBytes() as live:
        loss.backward()
    return int(live.peak)


def test_a_layer_of_gradients_less_at_the_peak() -> None:
    """Four units of four 128 x 128 fp32 matrices (64 KiB each) and a 1-token batch: the
    backward's peak is parameter-bound. Held gradients are a whole unit's beside its
    parameters; in-place, at most one matrix's gradient exists apart from its parameter (the
    kernel's output, before its AccumulateGrad): three matrices less."""
    layer = 3 * 128 * 128 * 4
    ref = run_threaded(_peak_of_backward, 2, False)
    ours = run_threaded(_peak_of_backward, 2, True)
    for r, o in zip(ref, ours, strict=True):
        assert r - o >= layer, (ref, ours)


def test_the_setter_checks_its_argument() -> None:
    def run(rank: int, world: int) -> None:
        mesh = init_device_mesh("cpu", (world,))
        model = fsdp_engine.fully_shard(nn.Linear(4, 4), mesh=mesh)
        with pytest.raises(TypeError, match="enabled must be a bool"):
            model.set_gradients_in_parameter_storage(1)

    run_threaded(run, 2)
