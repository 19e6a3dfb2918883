"""Fuzzing: a committed checkpoint of a ragged tensor loads bit-exactly under any other ragged (or
``Shard(0)``) layout at any other world size. Example count from ``FUZZ_EXAMPLES`` (default 15;
``nox -s fuzz`` runs 10,000)."""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Shard, init_device_mesh

from fsdp_engine import load_checkpoint, save_checkpoint
from ragged_dtensor import RaggedShard, distribute_tensor
from ragged_dtensor.testing import run_threaded

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "15"))


@st.composite
def layouts(draw: Any, shape: tuple[int, ...], world: int) -> tuple[Any, ...]:
    """("shard", (), ()) or ("ragged", dims, units): a prefix of the dims, units over ``world``
    ranks (zeros allowed) whose sum divides the prefix rows."""
    if draw(st.integers(0, 4)) == 0:
        return "shard", (), ()
    dims = tuple(range(draw(st.integers(1, len(shape)))))
    rows = 1
    for d in dims:
        rows *= shape[d]
    total = draw(st.sampled_from([d for d in range(1, rows + 1) if rows % d == 0]))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    bounds = [0, *cuts, total]
    return "ragged", dims, tuple(b - a for a, b in itertools.pairwise(bounds))


def _placement(kind: str, dims: tuple[int, ...], units: tuple[int, ...]) -> Any:
    return Shard(0) if kind == "shard" else RaggedShard(dims, units)


def _save(rank: int, world: int, full: torch.Tensor, layout: Any, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(full, mesh, [_placement(*layout)])
    save_checkpoint({"t": dt, "step": torch.tensor(7)}, Path(path))


def _load(rank: int, world: int, shape: tuple[int, ...], layout: Any, path: str) -> torch.Tensor:
    mesh = init_device_mesh("cpu", (world,))
    target = distribute_tensor(torch.zeros(shape), mesh, [_placement(*layout)])
    state = {"t": target, "step": torch.tensor(0)}
    load_checkpoint(state, Path(path))
    assert int(state["step"]) == 7
    return state["t"].full_tensor()


@st.composite
def cases(draw: Any) -> tuple[tuple[int, ...], int, Any, int, Any]:
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=3)))
    src_world, dst_world = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return (
        shape,
        src_world,
        draw(layouts(shape, src_world)),
        dst_world,
        draw(layouts(shape, dst_world)),
    )


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases())
def test_property_checkpoint_reshards_bit_exact(case: Any) -> None:
    shape, src_world, src, dst_world, dst = case
    full = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "step_1")
        run_threaded(_save, src_world, full, src, path, timeout=60)
        for got in run_threaded(_load, dst_world, shape, dst, path, timeout=60):
            assert torch.equal(got, full), (case, got, full)
