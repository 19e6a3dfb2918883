"""fsdp_engine's training steps never redistribute a ragged operand implicitly.

ragged_dtensor redistributes the ragged operands of an op with no ragged rule (a fallback that
communicates); strict mode refuses instead. With strict mode on, fully_shard's forward and
backward, SGD and AdamW (foreach and fused) and ``clip_grad_norm_`` (2-norm and inf-norm, with
ranks that hold no element of some parameters) run unchanged: the same parameters, bit for bit,
as the same run without strict mode, and not one fallback logged.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import fsdp_engine
import ragged_dtensor
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

STEPS = 3


def _layers() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 2), nn.Linear(2, 1))


# built once: the rank threads share torch's global generator, so they load these values
torch.manual_seed(0)
_INITIAL = {k: v.clone() for k, v in _layers().state_dict().items()}


def _model() -> nn.Module:
    model = _layers()
    model.load_state_dict(_INITIAL)
    return model


def _optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    fused = kind == "adamw_fused"
    return torch.optim.AdamW(
        model.parameters(), lr=1e-2, weight_decay=0.1, foreach=not fused, fused=fused
    )


def _train(rank: int, world: int, kind: str, strict: bool) -> tuple[bool, list[torch.Tensor]]:
    torch.set_num_threads(1)
    model = _model()
    for layer in model:
        if isinstance(layer, nn.Linear):
            fsdp_engine.fully_shard(layer)
    fsdp_engine.fully_shard(model)
    optim = _optimizer(kind, model)
    gen = torch.Generator().manual_seed(rank)
    empty = False
    with ragged_dtensor.strict_mode() if strict else contextlib.nullcontext():
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=gen)
            model(x).square().mean().backward()
            empty |= any(
                p.grad is not None and p.grad.to_local().numel() == 0 for p in model.parameters()
            )
            order = float("inf") if step % 2 else 2.0
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, norm_type=order)
            optim.step()
            optim.zero_grad()
    params = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    return empty, [p.detach() for p in params]


@pytest.mark.parametrize("kind", ["sgd", "adamw_foreach", "adamw_fused"])
def test_training_steps_run_unchanged_in_strict_mode(
    kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.DEBUG, logger="ragged_dtensor.fallback"):
        strict = run_threaded(_train, 4, kind, True, timeout=300)
        plain = run_threaded(_train, 4, kind, False, timeout=300)
    fallbacks = [r.getMessage() for r in caplog.records if r.name == "ragged_dtensor.fallback"]
    assert not fallbacks, fallbacks[:3]
    assert any(empty for empty, _ in strict)  # some rank holds no element of some parameter
    for (_, got), (_, want) in zip(strict, plain, strict=True):
        for g, w in zip(got, want, strict=True):
            assert torch.equal(g, w)
    assert not ragged_dtensor.is_strict()


def _any_fallback_is_refused(rank: int, world: int) -> str:
    model = _model()
    fsdp_engine.fully_shard(model)
    weight = next(iter(model.parameters()))
    try:
        with ragged_dtensor.strict_mode():
            weight.t()  # no ragged rule: the fallback would all-gather it
    except ragged_dtensor.RaggedOpError as exc:
        return str(exc)
    return "no error"


def test_strict_mode_is_on_in_that_run() -> None:
    """The control for the test above: the same model's sharded weight under strict mode
    refuses an op with no ragged rule."""
    for message in run_threaded(_any_fallback_is_refused, 2, timeout=120):
        assert "strict mode" in message and "aten.t" in message, message
