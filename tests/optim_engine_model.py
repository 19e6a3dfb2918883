"""The model both optimizer-on-engine integration tests train (test_integration_optim_engine,
test_integration_precond_engine), and its seeded initial state. A helper, not a test module."""

from __future__ import annotations

import threading

import torch
from torch import nn

LOCK = threading.RLock()
"""Threads share torch's global generator: every construction of a model holds this lock."""


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 96)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(96, 160), nn.GELU(), nn.Linear(160, 96)) for _ in range(2)
        )
        self.head = nn.Linear(96, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def init_state() -> dict[str, torch.Tensor]:
    """The seeded initial state dict every side of a comparison loads."""
    with LOCK, torch.random.fork_rng():  # threads share torch's global generator
        torch.manual_seed(0)
        return {k: v.clone() for k, v in Net().state_dict().items()}
