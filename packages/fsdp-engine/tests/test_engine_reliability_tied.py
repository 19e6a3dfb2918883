"""Tied (shared) parameters, e.g. an output head sharing the embedding matrix: nothing may be
silently untied, left unsharded or diverge across ranks. FSDP2 is the reference.

Numerics: same arithmetic as FSDP2 (one intra-op thread, same per-rank kernels, two ranks):
bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from engine_models import TinyLlama, batches, loss_fn
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine
from ragged_dtensor.testing import run_threaded


def _tied_model() -> TinyLlama:
    gen = torch.Generator().manual_seed(0)
    model = TinyLlama()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    model.head.weight = model.embed.weight  # (97, 32) both
    return model


def _train_tied(rank: int, world: int, engine: str) -> dict[str, Any]:
    api: Any = fsdp_engine if engine == "ours" else torch_fsdp
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = _tied_model()
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh)
    api.fully_shard(model, mesh=mesh)
    tied = model.head.weight is model.embed.weight
    sharded = isinstance(model.head.weight, DTensor)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for tokens in batches(3, 1, batch=4):
        loss = loss_fn(model, tokens.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    head = model.head.weight
    full = head.full_tensor() if isinstance(head, DTensor) else head.detach().clone()
    return {"tied": tied, "sharded": sharded, "losses": losses, "head": full}


@pytest.mark.numerics
def test_tied_weights_in_one_group_stay_tied_and_match_fsdp2() -> None:
    """Regression (found here, fixed in 0361240): ours sharded the first occurrence
    (``embed.weight``) and left the alias ``head.weight`` pointing at the original full,
    unsharded ``Parameter``: the tie broke, the head's gradient was never reduced across ranks
    and every rank updated its own copy (silent divergence)."""
    theirs = run_threaded(_train_tied, 2, "fsdp2", timeout=120)
    ours = run_threaded(_train_tied, 2, "ours", timeout=120)
    assert theirs[0]["tied"] and theirs[0]["sharded"]
    for rank in range(2):
        assert ours[rank]["tied"] and ours[rank]["sharded"], (rank, ours[rank]["tied"])
        assert ours[rank]["losses"] == theirs[rank]["losses"], (ours[rank]["losses"], theirs)
        assert torch.equal(ours[rank]["head"], theirs[rank]["head"])
    assert torch.equal(ours[0]["head"], ours[1]["head"]), "the ranks' heads diverged"


def _tied_across_groups(rank: int, world: int, engine: str) -> str:
    api: Any = fsdp_engine if engine == "ours" else torch_fsdp
    mesh = init_device_mesh("cpu", (world,))
    model = _tied_model()
    try:
        api.fully_shard(model.embed, mesh=mesh)  # embed.weight in its own group ...
        api.fully_shard(model, mesh=mesh)  # ... and again, as head.weight, in the root's
    except ValueError as exc:
        return f"ValueError: {exc}"
    tied = model.head.weight is model.embed.weight
    return f"no error (tied={tied})"


def test_a_parameter_shared_across_groups_raises_like_fsdp2() -> None:
    """FSDP2 raises "Parameter 'embed.weight' is shared with a parameter already managed by
    another FSDP group ...". Regression (found here, fixed in 0361240): ours accepted it and
    silently untied the two (each group sharded and trained its own copy)."""
    # (torch 2.13's FSDP2 accepts this and unties the two silently: "no error (tied=False)")
    ours = run_threaded(_tied_across_groups, 2, "ours", timeout=60)
    for message in ours:
        assert message.startswith("ValueError") and "weight" in message, message
        assert "shared" in message or "tied" in message, message
