"""torch.distributed.pipelining's schedules over fully_shard stages train like FSDP2's.

Each rank of a (pp, dp[, tp]) mesh builds the same model, keeps its pipeline stages' layers,
shards every layer and the stage module on the "dp" axis (after tensor parallelism on "tp"),
and runs torch 2.13's schedules (``PipelineStage`` and ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``) for two
SGD steps: the microbatches' backwards accumulate unsharded, the stage's ``REDUCE_GRAD`` runs
the post-backward by hand ([Note: pipeline stages] in ``pipelining``). Both engines run in the
same processes, one after the other: torch's FSDP2 is the control.

Numerics: the same arithmetic as FSDP2 (the same kernels on the same values, gradients summed
over microbatches in the same order, one reduce-scatter each): losses and gradients bitwise.
The zero-bubble schedule is the exception: its weight pass (``W``) sets ``.grad`` on the
unsharded parameters after the post-backward of its microbatch ran in the input pass (``I``).
Our post-backward moves the ``.grad`` it finds into the reduction's storage, FSDP2's leaves it
there, so with the order I0 I1 W0 I2 W1 W2 we sum ``dw0 + (dw1 + dw2)`` and FSDP2
``(dw0 + dw1) + dw2``: another float32 association (``ZB_TOLERANCE``; ~1e-8 observed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import engine
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

import fsdp_engine
from ragged_dtensor.testing import run_processes, run_threaded

DIM, HIDDEN, LAYERS, MICROBATCHES, STEPS = 8, 16, 8, 4, 2
SINGLE = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
LOOPED = {
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "zero_bubble": ScheduleInterleavedZeroBubble,
}
# float32 weight gradients of 4 microbatches associated differently (a few ulps of the sum)
ZB_TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean()


def _train(impl: str, schedule: str, mesh: Any, tp: bool) -> list[Any]:
    """Two steps of ``schedule``; returns each step's losses and full gradients (this rank's
    stages)."""
    api = engine(impl)
    pp_size, pp_rank = mesh["pp"].size(), mesh["pp"].get_local_rank()
    looped = schedule in LOOPED
    n_stages = pp_size * (2 if looped else 1)
    per = LAYERS // n_stages
    torch.manual_seed(0)
    layers = [Block() for _ in range(LAYERS)]
    stages, modules = [], []
    for index in range(pp_rank, n_stages, pp_size):
        module = nn.Sequential(*layers[index * per : (index + 1) * per])
        for block in module:
            if tp:
                plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
                parallelize_module(block, mesh["tp"], plan)
            # the zero-bubble schedule's weight pass reads the registered parameters: they
            # must stay unsharded after forward (FSDP2 needs it too)
            api.fully_shard(block, mesh=mesh["dp"], reshard_after_forward=schedule != "zero_bubble")
        api.fully_shard(module, mesh=mesh["dp"])
        modules.append(module)
        device = torch.device(mesh.device_type)
        stages.append(PipelineStage(module, index, n_stages, device, group=mesh.get_group("pp")))
    kinds = {**SINGLE, **LOOPED}
    runner = kinds[schedule](
        stages if looped else stages[0], n_microbatches=MICROBATCHES, loss_fn=_loss
    )
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in modules]
    gen = torch.Generator().manual_seed(10 + mesh["dp"].get_local_rank())
    results = []
    for _ in range(STEPS):
        x = torch.randn(2 * MICROBATCHES, DIM, generator=gen)
        target = torch.randn(2 * MICROBATCHES, DIM, generator=gen)
        losses: list[torch.Tensor] = []
        if pp_rank == 0:
            runner.step(x, target=target, losses=losses)
        else:
            runner.step(target=target, losses=losses)
        grads = {
            f"{i}.{name}": p.grad.full_tensor()
            for i, m in enumerate(modules)
            for name, p in m.named_parameters()
            if p.grad is not None
        }
        expected = sum(1 for m in modules for _ in m.parameters())
        assert len(grads) == expected, (impl, schedule, sorted(grads))
        for opt in optims:
            opt.step()
            opt.zero_grad()
        results.append(([loss.item() for loss in losses], grads))
    return results


def _both(rank: int, world: int, runs: list[tuple[str, bool]], dp: int) -> Any:
    """Each ``(schedule, tensor_parallel)`` of ``runs`` on FSDP2 then on ours: on a (2, world/2)
    ("pp", "dp") mesh, or a (2, dp, tp) one with tensor parallelism."""
    torch.set_num_threads(1)
    out = {}
    for schedule, tp in runs:
        if tp:
            dims, names = (2, dp, world // (2 * dp)), ("pp", "dp", "tp")
        else:
            dims, names = (2, world // 2), ("pp", "dp")
        mesh = init_device_mesh("cpu", dims, mesh_dim_names=names)
        for impl in ("fsdp2", "ours"):
            out[impl, schedule, tp] = _train(impl, schedule, mesh, tp)
    return out


def _check(results: list[Any]) -> None:
    for rank, out in enumerate(results):
        for impl, schedule, tp in out:
            if impl != "ours":
                continue
            theirs, ours = out["fsdp2", schedule, tp], out["ours", schedule, tp]
            for step, ((want_loss, want), (got_loss, got)) in enumerate(
                zip(theirs, ours, strict=True)
            ):
                where = (rank, schedule, tp, step)
                assert sorted(got) == sorted(want), where
                if schedule == "zero_bubble":
                    assert got_loss == pytest.approx(want_loss, rel=1e-6), where
                    for name in want:
                        torch.testing.assert_close(got[name], want[name], **ZB_TOLERANCE)
                    continue
                assert got_loss == want_loss, where  # bitwise (floats from .item())
                for name in want:
                    assert torch.equal(got[name], want[name]), (*where, name)


@pytest.mark.multiprocess
def test_pipeline_schedules_over_fully_shard_stages_train_like_fsdp2() -> None:
    """4 ranks. 2 stages x 2 data-parallel ranks: GPipe, interleaved 1F1B and interleaved zero
    bubble; 2 stages x 1 data-parallel x 2 tensor-parallel ranks: 1F1B. FSDP2's losses and
    gradients, step after step."""
    runs = [("gpipe", False), ("interleaved_1f1b", False), ("zero_bubble", False), ("1f1b", True)]
    _check(run_processes(_both, 4, runs, 1, timeout=600))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_every_pipeline_schedule_with_and_without_tensor_parallelism_trains_like_fsdp2() -> None:
    """4 ranks: every schedule over 2 stages x 2 data-parallel ranks, and over 2 stages x 2
    tensor-parallel ranks."""
    runs = [(s, tp) for s in [*SINGLE, *LOOPED] for tp in (False, True)]
    _check(run_processes(_both, 4, runs, 1, timeout=1800))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_pipeline_data_and_tensor_parallel_on_eight_ranks_train_like_fsdp2() -> None:
    """3-D: 2 stages x 2 data-parallel x 2 tensor-parallel ranks, every schedule."""
    runs = [(s, True) for s in [*SINGLE, *LOOPED]]
    _check(run_processes(_both, 8, runs, 2, timeout=1800))


def test_torchs_and_our_fully_shard_state_are_the_state_the_stage_drives() -> None:
    """The stage calls torch's ``fully_shard.state`` (or ours, with the switch on before
    pipelining is imported): both return our state, whose ``_state_ctx.all_states``,
    ``_fsdp_param_groups`` and ``_root_post_backward_final_callback`` are the names it uses."""
    import torch.distributed.fsdp as torch_fsdp

    def body(rank: int, world: int) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(Block(), Block())
        for block in model:
            fsdp_engine.fully_shard(block)
        fsdp_engine.fully_shard(model)
        state = fsdp_engine.fully_shard.state(model)
        assert torch_fsdp.fully_shard.state(model) is state
        assert torch_fsdp.fully_shard.state(model[0]) is fsdp_engine.fully_shard.state(model[0])
        model(torch.randn(2, DIM)).sum().backward()
        states = state._state_ctx.all_states
        assert [s.module for s in states] == [model, model[0], model[1]]
        assert [len(s._fsdp_param_groups) for s in states] == [0, 1, 1]
        for s in states:  # after a backward: nothing left to reduce, no collective
            for group in s._fsdp_param_groups:
                group.post_backward()
        state._root_post_backward_final_callback()
        assert all(p.grad is not None for p in model.parameters())

    run_threaded(body, 2)
