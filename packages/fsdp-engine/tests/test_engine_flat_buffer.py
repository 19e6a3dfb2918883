"""Each group's one flat buffer: parameters and gradients are zero-copy views of it, one
collective per group moves it each way (none at world size 1), and a block policy keeps blocks
whole in it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from engine_fsdp2 import (
    counting,
    data,
    full_params,
    sharded_stack_and_reference,
)
from engine_models import batches, build, loss_fn
from engine_training import sharded_tiny_llama
from torch.distributed.tensor import DTensor, init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor import (
    RaggedShard,  # torch's, also for the engine's RaggedShard
    storage_base,
)
from ragged_dtensor.testing import count_collectives, run_threaded


def _counts_and_zero_copy(rank: int, world: int) -> dict[str, Any]:
    model, _ = sharded_tiny_llama(world)
    state = model.__dict__["_fsdp_engine_state"]
    group = state.group
    # sharded parameters are RaggedShard views of the group's one shard storage
    for param, ref in zip(group.sharded, group.refs, strict=True):
        assert getattr(ref.owner, ref.attr) is param
        assert isinstance(param, DTensor)
        assert isinstance(param.placements[0], RaggedShard)
        # (each over a storage slice of its own elements: saved and copied as its own)
        assert param.to_local().numel() == 0 or (  # nothing to alias when empty
            storage_base(param.to_local())[0].data_ptr()
            == group.storage.buffer.shard.untyped_storage().data_ptr()
        )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(2, world)
    result: dict[str, Any] = {}
    for step, tokens in enumerate(data):
        with count_collectives() as counter:
            loss = loss_fn(model, tokens.chunk(world)[rank])
            forward = dict(counter.calls)
            loss.backward()
        result[f"step{step}"] = {"forward": forward, "total": dict(counter.calls)}
        # gradients are views of the gradient shard storage: no copy-in happened
        for param in group.sharded:
            assert param.grad is not None
            assert param.grad.to_local().numel() == 0 or (
                storage_base(param.grad.to_local())[0].data_ptr()
                == group.reducer.grads.buffer.shard.untyped_storage().data_ptr()
            )
        opt.step()
        opt.zero_grad()
    # after backward every unsharded storage is released
    for module in model.modules():
        st = module.__dict__.get("_fsdp_engine_state")
        if st is not None and st.group is not None:
            assert not st.group.storage.buffer.is_unsharded()
            assert not st.group.reducer.unsharded_grads.is_unsharded()
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_one_collective_per_group_and_zero_copy(world: int) -> None:
    results = run_threaded(_counts_and_zero_copy, world, timeout=120)
    groups = 3  # two layers and the root
    for result in results:
        for step in ("step0", "step1"):
            # forward: one all-gather per group; backward: the two resharded layers gather
            # again (the root keeps its parameters), one reduce-scatter per group
            assert result[step]["forward"] == {"all_gather_single": groups}, result
            assert result[step]["total"] == {
                "all_gather_single": groups + 2,
                "reduce_scatter_single": groups,
            }, result


def _single(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    model, reference, optim, ref_optim = sharded_stack_and_reference()
    total = 0
    for step in range(3):
        with counting() as counts:
            model(data(rank, step)).sum().backward()
        total += sum(counts.values())
        reference(data(rank, step)).sum().backward()
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    params = full_params(model)
    same = all(torch.equal(params[n], p) for n, p in reference.named_parameters())
    return total, same


@pytest.mark.numerics
def test_world_size_one_issues_no_collective() -> None:
    """On a single rank nothing is communicated (the all-gather and the reduce-scatter are the
    identity) and training is one process's, bitwise."""
    assert run_threaded(_single, 1) == [(0, True)]


def _block_policy(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = build()
    # whole rows of every matrix, whole 1-D tensors
    fully_shard(
        model, mesh=mesh, block_policy=lambda name, p: p.shape[-1] if p.dim() > 1 else p.numel()
    )
    for param in model.parameters():
        assert isinstance(param, DTensor)
        local = param.to_local()
        row = param.shape[-1] if param.dim() > 1 else param.numel()
        assert local.numel() % row == 0, (param.shape, local.numel())


def test_block_policy_keeps_blocks_whole() -> None:
    run_threaded(_block_policy, 3, timeout=60)
