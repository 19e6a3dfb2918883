"""A placed group's compact reduction (trainable ``Shard(0)`` members only) builds FSDP2's
reduce-scatter input with the planned path's one foreach add: each rank's segment holds every
trainable parameter's padded row chunk, back to back, and frozen members take no bytes.

Regression: the merge of the placed compact layout with the foreach ``add_compact`` left the
placed ``Reduction`` without its cut, so ``add_compact`` failed at ``torch.split``."""

from __future__ import annotations

import types
from typing import Any

import torch

from fsdp_engine._private.compact import add_compact, reduction_for_mask
from fsdp_engine._private.placed import placed_layout


def _fsdp2_input(grads: list[torch.Tensor], trainable: list[bool], world: int) -> torch.Tensor:
    """FSDP2's reduce-scatter input, written out: per rank, each trainable gradient's row chunk
    ``torch.chunk`` gives that rank, zero-padded to the first chunk's size."""
    segments = []
    for r in range(world):
        for grad, t in zip(grads, trainable, strict=True):
            if not t:
                continue
            rows = -(-grad.shape[0] // world)
            chunks = torch.chunk(grad, world, dim=0)
            part = chunks[r].reshape(-1) if r < len(chunks) else grad.new_zeros(0)
            padded = grad.new_zeros(rows * grad[0].numel())
            padded[: part.numel()] = part
            segments.append(padded)
    return torch.cat(segments)


def test_placed_compact_reduction_is_fsdp2_input_with_uneven_rows() -> None:
    shapes = [(5, 3), (5, 2), (3,), (7, 4)]
    trainable = [False, True, True, True]
    world = 4
    layout = placed_layout(shapes, [0] * len(shapes), world, align=4)
    storage: Any = types.SimpleNamespace(placed=layout, world=world, plan=None)
    reduction = reduction_for_mask(storage, tuple(trainable), align=4)
    assert reduction.kind == "compact"
    expected_segment = sum(layout.chunks[i] for i, t in enumerate(trainable) if t)
    assert reduction.segment == expected_segment  # FSDP2's bytes: no alignment
    assert sum(reduction.cut) == reduction.segment * world

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(s, generator=gen) for s in shapes]
    flat = torch.zeros(reduction.segment * world)
    given = [g if t else None for g, t in zip(grads, trainable, strict=True)]
    used = add_compact(flat, reduction, given)
    assert used == trainable
    expected = _fsdp2_input(grads, trainable, world)
    assert torch.equal(flat, expected)

    # a second add accumulates (gradient accumulation without resharding)
    add_compact(flat, reduction, given)
    assert torch.equal(flat, 2 * expected)


def test_placed_compact_reduction_skips_a_member_without_gradient() -> None:
    shapes = [(6, 2), (3, 3), (2,)]
    trainable = [True, True, False]
    layout = placed_layout(shapes, [0, 0, 0], 2, align=4)
    storage: Any = types.SimpleNamespace(placed=layout, world=2, plan=None)
    reduction = reduction_for_mask(storage, tuple(trainable), align=4)
    grads = [torch.ones(6, 2), None, None]
    flat = torch.zeros(reduction.segment * 2)
    assert add_compact(flat, reduction, grads) == [True, False, False]
    expected = _fsdp2_input([torch.ones(6, 2), torch.zeros(3, 3), torch.zeros(2)], trainable, 2)
    assert torch.equal(flat, expected)
