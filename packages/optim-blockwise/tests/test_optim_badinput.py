"""Bad-input catalogue (optimizer arguments): the stated error type, a message naming the
argument (or parameter) and the expected range."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import optim_blockwise as ob


def _w() -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.randn(8, 4))


def _muon_on_vector() -> object:
    bias = torch.nn.Parameter(torch.randn(4))
    return ob.Muon([{"params": [bias], "param_names": ["layer.bias"], "use_muon": True}])


CASES: dict[str, tuple[Callable[[], object], type[Exception], tuple[str, ...]]] = {
    "AdamW8bit lr < 0": (lambda: ob.AdamW8bit([_w()], lr=-1), ValueError, ("lr", "-1")),
    "AdamW8bit beta2 = 1": (
        lambda: ob.AdamW8bit([_w()], betas=(0.9, 1.0)),
        ValueError,
        ("betas", "[0, 1)", "(0.9, 1.0)"),
    ),
    "AdamW8bit eps < 0": (lambda: ob.AdamW8bit([_w()], eps=-1e-8), ValueError, ("eps", "-1e-08")),
    "AdamW8bit weight_decay < 0": (
        lambda: ob.AdamW8bit([_w()], weight_decay=-0.1),
        ValueError,
        ("weight_decay", "-0.1"),
    ),
    "AdamW8bit block_size 0": (
        lambda: ob.AdamW8bit([_w()], block_size=0),
        ValueError,
        ("block_size", "got 0"),
    ),
    "AdamW8bit block policy of block 0": (
        lambda: ob.AdamW8bit.block_policy(block_size=0),
        ValueError,
        ("block_size", "got 0"),
    ),
    "Muon lr < 0": (lambda: ob.Muon([_w()], lr=-1), ValueError, ("lr", "-1")),
    "Muon momentum = 1": (
        lambda: ob.Muon([_w()], momentum=1.0),
        ValueError,
        ("momentum", "[0, 1)", "1.0"),
    ),
    "Muon weight_decay < 0": (
        lambda: ob.Muon([_w()], weight_decay=-1),
        ValueError,
        ("weight_decay", "-1"),
    ),
    "Muon ns_steps 0": (lambda: ob.Muon([_w()], ns_steps=0), ValueError, ("ns_steps", "got 0")),
    "Muon adjust_lr_fn unknown": (
        lambda: ob.Muon([_w()], adjust_lr_fn="bogus"),
        ValueError,
        ("adjust_lr_fn", "'bogus'", "'original'"),
    ),
    "Muon on a 1-D parameter": (
        _muon_on_vector,
        ValueError,
        ("use_muon=True", "'layer.bias'", "(4,)", "2-D"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_names_the_offender(name: str) -> None:
    fn, kind, fragments = CASES[name]
    with pytest.raises(kind) as info:
        fn()
    for fragment in fragments:
        assert fragment in str(info.value), (name, str(info.value))


# Arguments that used to be accepted without validation (adamw8bit.py / muon.py ``__init__``),
# now rejected at construction as torch.optim.AdamW does ("Invalid learning rate: nan", ...).
UNCHECKED: dict[str, Callable[[], object]] = {
    # ``lr < 0.0`` is False for NaN: the first step makes every parameter NaN
    "AdamW8bit lr NaN": lambda: ob.AdamW8bit([_w()], lr=float("nan")),
    "Muon lr NaN": lambda: ob.Muon([_w()], lr=float("nan")),
    # the AdamW path of Muon uses adamw_betas / adamw_eps unchecked: (1.5, 0.9) trains silently
    "Muon adamw_betas out of [0, 1)": lambda: ob.Muon([_w()], adamw_betas=(1.5, 0.9)),
    "Muon eps < 0": lambda: ob.Muon([_w()], eps=-1.0),
    # two coefficients fail only at the first step ("not enough values to unpack"), unnamed
    "Muon ns_coefficients of length 2": lambda: ob.Muon([_w()], ns_coefficients=(1.0, 2.0)),  # type: ignore[arg-type]
}


@pytest.mark.parametrize("name", list(UNCHECKED))
def test_unchecked_arguments_are_rejected_at_construction(name: str) -> None:
    """Fix: validate with ``math.isfinite(lr) and lr >= 0``, ``0 <= beta < 1`` for
    ``adamw_betas``, ``eps >= 0`` / ``adamw_eps >= 0`` and ``len(ns_coefficients) == 3``,
    raising ValueError naming the argument, as for the arguments already checked."""
    with pytest.raises(ValueError):
        UNCHECKED[name]()


def test_sparse_gradient_is_named_as_such() -> None:
    """Found here, FAILS today: a sparse gradient (``nn.Embedding(sparse=True)``) makes
    ``AdamW8bit.step`` raise "local tensor of shape (8, 4) is not contiguous; the optimizers
    update local data in place through a flat view", which sends the user looking at their
    parameter's memory layout. Say that sparse gradients are not supported (as
    ``torch.optim.AdamW`` does: "AdamW does not support sparse gradients")."""
    weight = _w()
    weight.grad = torch.randn(8, 4).to_sparse()
    with pytest.raises((ValueError, RuntimeError), match="sparse"):
        ob.AdamW8bit([weight]).step()
