"""Shared pieces of the FSDP2-behaviour tests: small models, the two engines behind one name, and
collective counting that works for both (torch's CommDebugMode counts c10d ops at dispatch).

The tests state FSDP2's behaviours in our own words (from reading torch's FSDP2 test files) and
run the same body against torch's FSDP2 as the control wherever it runs on CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from engine_models import RNG_LOCK
from torch import nn

import fsdp_engine
from ragged_dtensor.testing import count_collectives

ALL_GATHER = "all_gather_single"
REDUCE_SCATTER = "reduce_scatter_single"
ALL_REDUCE = "all_reduce"
ENGINES = ["ours", "fsdp2"]  # fsdp_engine, and torch's FSDP2 as the control


def engine(name: str) -> Any:
    """``"ours"``: fsdp_engine; ``"fsdp2"``: torch.distributed.fsdp (same names)."""
    if name == "ours":
        return fsdp_engine
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp


class Mlp(nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 12, bias: bool = True) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Stack(nn.Module):
    """An input projection owned by the root, ``n`` MLP blocks, an output projection."""

    def __init__(self, n: int = 2, dim: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Mlp(dim) for _ in range(n))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def make(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    """Build a module with the same weights on every (threaded) rank: threads share torch's
    generator, so construction is seeded and serialised."""
    with RNG_LOCK, torch.random.fork_rng():
        torch.manual_seed(seed)
        return factory()


def shard_stack(api: Any, model: Stack, **kwargs: Any) -> None:
    for block in model.blocks:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)


def sharded_stack_and_reference() -> tuple[nn.Module, nn.Module, Any, Any]:
    """A ``Stack`` sharded by fsdp_engine, an unsharded one with the same init (one process's
    reference), and an Adam (lr 1e-2) for each."""
    model = make(Stack)
    reference = make(Stack)
    shard_stack(engine("ours"), model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    return model, reference, optim, ref_optim


def data(rank: int, step: int = 0, batch: int = 4, dim: int = 8) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(100 * step + rank))


@contextlib.contextmanager
def counting() -> Iterator[dict[str, int]]:
    """Counts of the ``torch.distributed`` collectives this rank issues inside the block (both
    engines call them by module attribute; per thread, so it works on the threaded group where
    CommDebugMode's global module tracking does not)."""
    counts: dict[str, int] = {}
    with count_collectives() as counter:
        yield counts
    counts.update(counter.calls)


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grad = param.grad
        out[name] = None if grad is None else grad.full_tensor().clone()  # type: ignore[attr-defined]
    return out


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
        for name, p in model.named_parameters()
    }


@contextlib.contextmanager
def recording_reduce_scatter() -> Iterator[list[tuple[int, torch.dtype]]]:
    """(numel, dtype) of every reduce-scatter output, whichever engine issues it. Patches
    ``dist.reduce_scatter_single`` (what both call in torch 2.13) for all threads."""
    seen: list[tuple[int, torch.dtype]] = []
    original = dist.reduce_scatter_single

    def record(output: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        seen.append((output.numel(), output.dtype))
        return original(output, *args, **kwargs)

    dist.reduce_scatter_single = record
    try:
        yield seen
    finally:
        dist.reduce_scatter_single = original
