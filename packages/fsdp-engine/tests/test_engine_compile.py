"""torch.compile: fully_shard's hooks are hidden from dynamo, like FSDP2's, and compiled
blocks train exactly like eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from engine_fsdp2 import Stack, data, engine, full_params, make, shard_stack

pytestmark = pytest.mark.numerics


def _explain_block(impl: str) -> tuple[int, int, list[str]]:
    """Graphs and breaks dynamo makes of one fully_shard block called with its hooks (what
    ``block.compile()`` compiles), on a fake two-rank process group in this process (its
    collectives do nothing: only the graph structure is looked at)."""
    from torch.distributed.tensor import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        model = make(Stack)
        assert isinstance(model, Stack)
        shard_stack(engine(impl), model, mesh=init_device_mesh("cpu", (2,)))
        x = data(0)
        model(x).sum().backward()  # lazy init
        torch._dynamo.reset()
        out = torch._dynamo.explain(model.blocks[0])(x)
        return out.graph_count, out.graph_break_count, [str(r.reason) for r in out.break_reasons]
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_hooks_are_hidden_from_dynamo() -> None:
    """FSDP2 runs its hooks outside dynamo's graphs (``torch._dynamo.disable``): compiling a
    fully_shard module keeps its forward one graph. Ours too ([Note: hooks and torch.compile]
    in state.py); traced, our pre-forward all-gather was one graph break per block."""
    assert _explain_block("fsdp2")[:2] == (1, 0)
    assert _explain_block("ours") == (1, 0, [])


def _compiled_training(rank: int, world: int, compiled: bool) -> tuple[list[float], Any]:
    from torch.distributed.tensor import init_device_mesh

    torch.set_num_threads(1)
    model = make(Stack)
    assert isinstance(model, Stack)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        engine("ours").fully_shard(block, mesh=mesh)
        if compiled:
            block.compile(backend="aot_eager")
    engine("ours").fully_shard(model, mesh=mesh)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        loss = model(data(rank, step)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, full_params(model)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_compiled_blocks_train_like_eager() -> None:
    """Blocks compiled after fully_shard (``block.compile()``, hooks hidden from dynamo) train
    exactly like eager on gloo processes. Same arithmetic: ``aot_eager`` runs the traced aten
    ops with the eager kernels, one thread, world size 2 (a two-term mean); bitwise. Slow (two
    gloo launches and a compile, ~30 s)."""
    from ragged_dtensor.testing import run_processes

    eager = run_processes(_compiled_training, 2, False, timeout=300)
    compiled = run_processes(_compiled_training, 2, True, timeout=300)
    for (l1, p1), (l2, p2) in zip(compiled, eager, strict=True):
        assert l1 == l2
        for name, value in p2.items():
            assert torch.equal(p1[name], value), name
