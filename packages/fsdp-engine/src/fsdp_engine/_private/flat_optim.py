"""An optimizer over each group's flat shard: one tensor per ``fully_shard`` call.

[Note: why a flat optimizer]
``torch.optim.AdamW`` on DTensor parameters pays one DTensor dispatch per parameter and op; on a
model of many small parameters (MoE experts, norms, biases) that is a third of the step. The
parameters of a group are views of one flat shard storage, and their reduced gradients views of
one flat gradient storage, so an *elementwise* optimizer (AdamW, Adam, SGD, ...) can run on the
flat tensors instead: the same values element by element (padding is zero and stays zero: zero
gradient, zero moments, zero update, and decay of zero is zero), one kernel per group.

Limits, by construction: one set of hyper-parameters for every element (no per-parameter groups,
e.g. no weight-decay exemption for norms), elementwise optimizers only (not Muon, not 8-bit
blocks), a parameter whose gradient is absent in a step is still stepped with a zero gradient,
and the optimizer state is per-rank flat memory (save it with the same world size and plan;
for resharding checkpoints use a per-parameter optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdp_engine._private.group import ParamGroup
from fsdp_engine._private.state import get_state

__all__ = ["FlatShardOptimizer"]


class FlatShardOptimizer:
    """``FlatShardOptimizer(model, torch.optim.AdamW, lr=..., weight_decay=...)``.

    ``step()`` and ``zero_grad()`` behave like the wrapped optimizer's; the parameters it updates
    are the flat shards of every ``fully_shard`` group in ``model``.
    """

    def __init__(
        self, model: nn.Module, optimizer: Callable[..., torch.optim.Optimizer], **kwargs: Any
    ) -> None:
        self.model = model
        self.groups: list[ParamGroup] = [
            state.group
            for m in model.modules()
            if (state := get_state(m)) is not None and state.group is not None
        ]
        if not self.groups:
            raise ValueError("FlatShardOptimizer: the model has no fully_shard parameters")
        self.flat = [group.params.shard for group in self.groups]
        self.optimizer = optimizer(self.flat, **kwargs)

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self) -> None:
        for flat, group in zip(self.flat, self.groups, strict=True):
            group.wait_for_reduce()
            flat.grad = None if group.grads is None else group.grads.shard
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop every gradient (the engine lets the gradient storage go until the next
        reduction; ``set_to_none=False`` zeroes it in place instead)."""
        self.model.zero_grad(set_to_none=set_to_none)
        for flat in self.flat:
            flat.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)
