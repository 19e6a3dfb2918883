"""Conditional compute for the gloo tests: a branch that some ranks skip, and a mixture of experts
that loops over its experts and skips those without tokens (as several Hugging Face MoE layers
do). Written here; no download.

``run_case(rank, world, case, micro)`` trains two steps on every rank with fsdp_engine and, in
the same process, computes the reference of one process: the gradient of the mean loss over the
global batch, as the mean of the per-slice gradients (by linearity the same quantity), summed in
rank order. It returns what the test compares.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor import distribute_tensor  # torch's, also for the engine's RaggedShard

DIM = 8
STEPS = 2
LR = 0.1


class Block(nn.Module):
    """``branch`` runs only when the caller asks; ``never`` never runs (no rank uses it)."""

    def __init__(self) -> None:
        super().__init__()
        self.main = nn.Linear(DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.never = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        y = torch.tanh(self.main(x))
        if use_branch:
            y = y + torch.tanh(self.branch(y))
        return y


class BranchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.block = Block()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        return self.head(self.block(torch.tanh(self.inp(x)), use_branch))


class TwiceNet(BranchNet):
    """The block runs twice per forward: its group reduces twice in one backward (the second
    reduction must not start before the first has released the storage it reads)."""

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        y = self.block(torch.tanh(self.inp(x)), use_branch)
        return self.head(self.block(y, not use_branch))


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, 2 * DIM)
        self.w2 = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)))


class MoE(nn.Module):
    """Top-1 routing given by ``expert_ids`` (the router's softmax still weighs each token, so
    the router trains); experts without tokens on this rank are skipped."""

    def __init__(self, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, experts, bias=False)
        self.experts = nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        gates = torch.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            idx = (expert_ids == e).nonzero(as_tuple=True)[0]
            if idx.numel() == 0:
                continue
            out = out.index_add(0, idx, expert(x[idx]) * gates[idx, e : e + 1])
        return x + out


class MoENet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.moe = MoE()
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, expert_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(torch.tanh(self.inp(x)), expert_ids))


def _expert_ids(rank: int, world: int, step: int, tokens: int) -> torch.Tensor:
    """Expert 0 gets tokens on every rank; expert 1 only on rank 0; expert 2 only on the last
    rank and only at step 1; expert 3 on no rank (its parameters get no gradient anywhere)."""
    ids = torch.zeros(tokens, dtype=torch.long)
    if rank == 0:
        ids[::2] = 1
    if rank == world - 1 and step == 1:
        ids[1::3] = 2
    return ids


def _batch(case: str, rank: int, world: int, step: int, micro: int) -> tuple[Any, ...]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randn(6, DIM, generator=gen)
    target = torch.randn(6, 1, generator=gen)
    if case in ("branch", "twice"):
        # the branch runs on rank 0 always, on the other ranks at step 1 of the first
        # microbatch only: rank 1 skips it at step 0 (and everyone but rank 0 at micro 1)
        return x, target, rank == 0 or (step == 1 and micro == 0)
    return x, target, _expert_ids(rank, world, step, x.shape[0])


def _build(case: str) -> nn.Module:
    torch.manual_seed(0)  # each process: the same initial weights on every rank
    return {"branch": BranchNet, "twice": TwiceNet, "moe": MoENet}[case]()


def _shard(case: str, model: nn.Module, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    inner = model.moe if case == "moe" else model.block  # type: ignore[union-attr]
    fully_shard(inner, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _loss(model: nn.Module, batch: tuple[Any, ...], micro: int) -> torch.Tensor:
    x, target, route = batch
    return ((model(x, route) - target) ** 2).mean() / micro


def _reference_grads(
    case: str, model: nn.Module, world: int, step: int, micro: int
) -> dict[str, torch.Tensor | None]:
    """One process: per-slice gradients (microbatches accumulated in order), then their mean
    summed in rank order. ``None`` where no slice uses the parameter."""
    per_rank: list[dict[str, torch.Tensor | None]] = []
    for r in range(world):
        model.zero_grad(set_to_none=True)
        for m in range(micro):
            _loss(model, _batch(case, r, world, step, m), micro).backward()
        per_rank.append(
            {
                n: (p.grad.clone() if p.grad is not None else None)
                for n, p in model.named_parameters()
            }
        )
    out: dict[str, torch.Tensor | None] = {}
    for name, param in model.named_parameters():
        grads = [g[name] for g in per_rank]
        if all(g is None for g in grads):
            out[name] = None
            continue
        total = torch.zeros_like(param)
        for g in grads:
            if g is not None:
                total = total + g
        out[name] = total * (1.0 / world)
    model.zero_grad(set_to_none=True)
    return out


def _abs_sum(
    case: str, model: nn.Module, world: int, step: int, micro: int
) -> dict[str, torch.Tensor]:
    """Sum over ranks of |per-slice gradient| (for the rounding bound at world size > 2)."""
    sums: dict[str, torch.Tensor] = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for r in range(world):
        model.zero_grad(set_to_none=True)
        for m in range(micro):
            _loss(model, _batch(case, r, world, step, m), micro).backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                sums[n] += p.grad.abs()
    model.zero_grad(set_to_none=True)
    return sums


def _local(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's share of ``full`` in ``like``'s layout (cut locally, no communication)."""
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def run_case(rank: int, world: int, case: str, micro: int, exact: bool) -> dict[str, Any]:
    """``exact``: ``set_reduce_scatter_unused_params(False)``, so parameters no rank used lose
    their ``.grad`` like with one process; else (the default) they keep a zero one."""
    torch.set_num_threads(1)
    reference = _build(case)
    model = copy.deepcopy(reference)
    _shard(case, model, world)
    model.set_reduce_scatter_unused_params(not exact)  # type: ignore[operator]
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=LR)
    # [rounding] at world size 2 the reduction adds two terms (a + b == b + a) and scales by a
    # power of two: the same arithmetic as the reference, compared bitwise. Beyond, gloo's
    # summation order is its own: |fl(sum) - sum| <= gamma_{m-1} * sum |g_r| for each result
    # (Higham, gamma_k = k*eps/(1 - k*eps), eps = 2**-24), so the two sums differ by at most
    # twice that, divided by m like the mean.
    eps = 2.0**-24
    gamma = (world - 1) * eps / (1 - (world - 1) * eps)
    report: dict[str, Any] = {"presence": [], "grad_errors": [], "param_errors": []}
    for step in range(STEPS):
        if world > 2:
            # compare each step's gradient from the same parameters (rounded sums differ, so
            # the trajectories would drift apart by more than one step's rounding)
            with torch.no_grad():
                for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
                    ref.copy_(param.full_tensor())
        ref_grads = _reference_grads(case, reference, world, step, micro)
        bounds = _abs_sum(case, reference, world, step, micro)
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)  # type: ignore[operator]
            _loss(model, _batch(case, rank, world, step, m), micro).backward()
        presence = {n: p.grad is not None for n, p in model.named_parameters()}
        report["presence"].append(presence)
        for name, param in model.named_parameters():
            want = ref_grads[name]
            if want is None and not exact:
                want = torch.zeros_like(reference.get_parameter(name))  # kept, as zeros
            if (param.grad is None) != (want is None):
                report["grad_errors"].append(f"step {step} {name}: presence differs")
                continue
            if want is None:
                continue
            got = param.grad.to_local()
            expected = _local(want, param)
            if world == 2:
                ok = torch.equal(got, expected)
            else:
                limit = _local(bounds[name], param) * (2 * gamma / world)
                ok = bool(((got - expected).abs() <= limit).all())
            if not ok:
                worst = (got - expected).abs().max().item() if got.numel() else 0.0
                report["grad_errors"].append(f"step {step} {name}: max |diff| {worst:.3g}")
        for p, g in zip(reference.parameters(), ref_grads.values(), strict=True):
            p.grad = g if g is not None or exact else torch.zeros_like(p)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=True)
        optim.zero_grad(set_to_none=True)
        if world == 2:  # same arithmetic all along: the parameters agree bitwise
            for (name, param), ref in zip(
                model.named_parameters(), reference.parameters(), strict=True
            ):
                if not torch.equal(param.to_local(), _local(ref.detach(), param)):
                    report["param_errors"].append(f"step {step} {name}")
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, report["presence"])
    report["presence_same_on_every_rank"] = all(g == report["presence"] for g in gathered)
    return report
