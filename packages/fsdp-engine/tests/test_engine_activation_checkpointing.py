"""Activation checkpointing: recompute in backward sees unsharded parameters (every
checkpoint flavour, fully_shard modules nested in the checkpointed block, one or two forwards),
like FSDP2.

Numeric kind: *same arithmetic* (bitwise) except where the test's docstring derives a bound.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_fsdp2 import Mlp, data, engine, full_grads, make
from torch import nn

from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


class _Checkpointed(nn.Module):
    """A block whose inner modules are fully_shard modules of their own (nested)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = Mlp()
        self.ffn = Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x)
        return x + self.ffn(x)


class _CkptModel(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.proj = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(_Checkpointed() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.proj(x)
        for block in self.blocks:
            if self.how in ("reentrant", "non_reentrant"):
                x = checkpoint(block, x, use_reentrant=self.how == "reentrant")
            else:
                x = block(x)
        return x


def _ckpt(rank: int, world: int, impl: str, how: str, raf: bool, forwards: int) -> Any:
    torch.set_num_threads(1)
    api = engine(impl)
    model = make(lambda: _CkptModel(how))
    if how == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
            apply_activation_checkpointing,
        )

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, _Checkpointed))
    if how == "composable":
        from torch.distributed._composable import checkpoint

        for block in model.blocks:
            checkpoint(block)
    for module in model.modules():
        if isinstance(module, _Checkpointed):
            api.fully_shard(module.attn, reshard_after_forward=raf)
            api.fully_shard(module.ffn, reshard_after_forward=raf)
            api.fully_shard(module, reshard_after_forward=raf)
    api.fully_shard(model, reshard_after_forward=raf)
    # two forwards then one backward (e.g. DPO's chosen and rejected passes)
    outs = [model(data(rank, i)) for i in range(forwards)]
    loss = sum(((o.sum() - i) ** 2 for i, o in enumerate(outs)), torch.zeros(()))
    loss.backward()
    grads = full_grads(model)
    return {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in grads.items()}


def _abs_terms(rank: int, world: int, forwards: int) -> dict[str, torch.Tensor]:
    """Sum over ranks and forwards of |each forward's gradient on each rank| (one process per
    rank, no sharding): the rounding bound's scale."""
    torch.set_num_threads(1)
    plain = make(lambda: _CkptModel("none"))
    total = {n: torch.zeros_like(p) for n, p in plain.named_parameters()}
    for i in range(forwards):
        plain.zero_grad(set_to_none=True)
        outs = [plain(data(rank, f)) for f in range(forwards)]
        ((outs[i].sum() - i) ** 2).backward()
        for n, p in plain.named_parameters():
            assert p.grad is not None
            total[n] += p.grad.abs()
    for value in total.values():
        dist.all_reduce(value)
    return total


@pytest.mark.parametrize("how", ["non_reentrant", "reentrant", "wrapper", "composable"])
@pytest.mark.parametrize("forwards", [1, 2])
def test_activation_checkpointing_recompute_sees_unsharded_parameters(
    how: str, forwards: int
) -> None:
    """Recompute inside backward (torch.utils.checkpoint reentrant or not, checkpoint_wrapper,
    composable checkpoint), with fully_shard modules nested inside the checkpointed block and
    one or two forwards before backward: every gradient equals the run without checkpointing,
    bitwise, for both reshard_after_forward settings. FSDP2 is the control except with the
    reentrant variant and two forwards, where it leaves unsharded parameters registered with
    plain-tensor gradients (FSDP2 supports non-reentrant checkpointing only).

    With the reentrant variant and two forwards each checkpointed call backpropagates on its
    own, so a parameter's four contributions (two ranks x two forwards, each halved) are
    reduced in a different association than without checkpointing: *different arithmetic*,
    both sums within gamma_3 * sum|t| / 2 of the exact one (Higham, gamma_3 = 3 eps /
    (1 - 3 eps), eps = 2**-24), so they differ by at most twice that."""
    control = not (how == "reentrant" and forwards == 2)
    bound = None if control else run_threaded(_abs_terms, 2, forwards)[0]
    gamma = 3 * 2.0**-24 / (1 - 3 * 2.0**-24)
    for raf in (True, False):
        want = run_threaded(_ckpt, 2, "ours", "none", raf, forwards)[0]
        ours = run_threaded(_ckpt, 2, "ours", how, raf, forwards)[0]
        theirs = run_threaded(_ckpt, 2, "fsdp2", how, raf, forwards)[0] if control else want
        for name, grad in want.items():
            assert grad is not None and theirs[name] is not None, name
            if bound is None:
                assert torch.equal(ours[name], grad), (raf, name)
            else:
                limit = 2 * gamma * bound[name] / 2
                assert ((ours[name] - grad).abs() <= limit).all(), (raf, name)
            assert torch.equal(theirs[name], grad), (raf, name)
