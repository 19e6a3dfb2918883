"""Regression: an 8-bit second moment that rounds to zero must not blow the update up.

In a block whose largest v is big, a small element's v can fall below the unsigned map's smallest
code while its m (quantized against m's own absmax) does not; once that element's gradient
vanishes, m / (sqrt(v) + eps) would be ~m / eps. Found by benchmarks/bench_optim_engine.py (an
embedding row moved by 17.8 at lr 3e-3)."""

from __future__ import annotations

import pytest
import torch

import optim_blockwise as ob

pytestmark = pytest.mark.numerics


def test_adam_update_stays_bounded_when_a_gradient_vanishes() -> None:
    lr = 3e-3
    weight = torch.nn.Parameter(torch.zeros(64, 128))  # 8192 elements: 8-bit state
    opt = ob.AdamW8bit([weight], lr=lr, betas=(0.9, 0.95), weight_decay=0.0, block_size=256)
    worst = 0.0
    for step in range(30):
        grad = torch.zeros(64, 128)
        grad[0, 0] = 100.0  # the block's largest moment
        if step < 3:
            grad[0, 1] = 1e-3  # a rare, small gradient (an embedding row seen once)
        weight.grad = grad
        before = weight.detach().clone()
        opt.step()
        worst = max(worst, (weight.detach() - before).abs().max().item())
    # Adam moves a weight by about lr per step (bias correction can add a small factor)
    assert worst <= 10 * lr, worst
