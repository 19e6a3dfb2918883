"""Real gloo processes (world sizes 2 and 4) and torch FSDP2 ``fully_shard`` models."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from optim_support import (
    check_against_single,
    dist_run_steps,
    from_bytes,
    ragged_spec,
    run_steps,
    to_bytes,
)

import optim_blockwise as ob
from ragged_dtensor.testing import run_processes, run_threaded

SHAPES = [(64, 96), (40, 50), (7,), (128, 33), (256, 32)]
PLAIN = [("plain",)] * len(SHAPES)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("adamw8bit", "aligned", {"lr": 1e-2, "block_size": 256}),
    ("adamw8bit", "chunk", {"lr": 1e-2, "block_size": 256}),
    ("muon", "elementwise", {"lr": 2e-2, "ns_dtype": torch.float32}),
    ("muon", "chunk", {"lr": 2e-2}),
]


def _specs(how: str, world: int) -> list[tuple[Any, ...]]:
    if how == "chunk":
        return [("chunk",)] * len(SHAPES)
    unit = 256 if how == "aligned" else 1
    return [
        ragged_spec(s, world, unit if math.prod(s) % unit == 0 else 1, seed=world * 3 + i)
        for i, s in enumerate(SHAPES)
    ]


def _all_cases(rank: int, world: int) -> bytes:
    # One process group for every case: spawning is the expensive part on 2 cores.
    out = [
        dist_run_steps(rank, world, kind, SHAPES, _specs(how, world), 5, kwargs)
        for kind, how, kwargs in CASES
    ]
    return to_bytes(out)


@pytest.mark.numerics
@pytest.mark.multiprocess
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4: CI budget
def test_gloo_processes_equal_single_device(world: int) -> None:
    """AdamW8bit (block-aligned RaggedShard, and FSDP2-style Shard(0) cutting blocks) and
    distributed Muon (fp32 and bf16 NS) on real gloo processes, 5 steps: bit-identical states
    and parameters to the single-process optimizers (same arithmetic: the same elementwise
    kernels and the same NS on whole matrices, one intra-op thread on both sides)."""
    per_rank = [from_bytes(b) for b in run_processes(_all_cases, world, timeout=240, threads=1)]
    torch.set_num_threads(1)  # same arithmetic: the ranks ran with one intra-op thread too
    for c, (kind, how, kwargs) in enumerate(CASES):
        single = run_steps(None, kind, SHAPES, PLAIN, 5, kwargs)
        results = [r[c] for r in per_rank]
        check_against_single(results, single, SHAPES, _specs(how, world), 256)


class _TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
            for _ in range(2)
        )
        self.head = torch.nn.Linear(32, 64, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw8bit":
        return ob.AdamW8bit(model.parameters(), lr=1e-2, block_size=64, min_8bit_size=1024)
    hidden = [p for n, p in model.named_parameters() if p.dim() == 2 and "blocks" in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "blocks" in n)]
    return ob.Muon(
        [{"params": hidden}, {"params": other, "use_muon": False}],
        lr=1e-2,
        ns_dtype=torch.float32,
        adjust_lr_fn="match_rms_adamw",
    )


def _train(model: torch.nn.Module, kind: str, steps: int) -> list[float]:
    opt = _make_optimizer(kind, model)
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 16), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _fsdp2_run(
    rank: int, world: int, kind: str, init: dict[str, torch.Tensor]
) -> tuple[list[float], dict[str, torch.Tensor]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    model = _TinyLM()  # threads share the global RNG: load the initial weights explicitly
    model.load_state_dict(init)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    losses = _train(model, kind, 5)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return losses, full


@pytest.mark.numerics
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module")
@pytest.mark.parametrize("kind", ["adamw8bit", "muon"])
def test_torch_fsdp2_fully_shard_matches_single_device(kind: str) -> None:
    """Our optimizers on torch FSDP2 ``Shard(0)`` params equal the single-device run bitwise.

    Same arithmetic: every rank sees the same batch, so each rank's gradient is the
    single-device one and their average over 2 ranks ((g + g) / 2) is exact; the 8-bit update
    is elementwise on whole blocks and Muon orthogonalizes each whole matrix once; one intra-op
    thread on both sides."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = _TinyLM()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    ref_losses = _train(model, kind, 5)
    out = run_threaded(_fsdp2_run, 2, kind, init, timeout=120)
    for losses, full in out:
        assert losses == ref_losses
        for name, p in model.named_parameters():
            assert torch.equal(full[name], p.detach()), name
