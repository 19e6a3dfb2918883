"""Bad input gets a ValueError that names the problem (and never wrong data or a hang)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from ragged_dtensor import RaggedShard, distribute_tensor, from_local
from ragged_dtensor.testing import run_threaded

CASES: dict[str, tuple[Callable[[Any, int], object], str]] = {
    "units length != mesh axis size": (
        lambda mesh, rank: distribute_tensor(
            torch.zeros(6, 2), mesh, [RaggedShard((0,), (1, 1, 1))]
        ),
        "3 local_units but the axis has 2 ranks",
    ),
    "sum does not divide the prefix rows": (
        lambda mesh, rank: distribute_tensor(torch.zeros(6, 2), mesh, [RaggedShard((0,), (2, 2))]),
        "does not divide the 6 prefix rows",
    ),
    "dims beyond the tensor": (
        lambda mesh, rank: distribute_tensor(torch.zeros(6), mesh, [RaggedShard((0, 1), (1, 1))]),
        "exceed the tensor's 1 dimensions",
    ),
    "from_local without shape": (
        lambda mesh, rank: from_local(torch.zeros(3), mesh, [RaggedShard((0,), (1, 1))]),
        "needs shape=",
    ),
    "local size disagrees with the units": (
        lambda mesh, rank: from_local(
            torch.zeros(5), mesh, [RaggedShard((0,), (1, 2))], shape=(6, 2)
        ),
        "local tensor has 5 elements but",
    ),
    "non-contiguous local tensor": (
        lambda mesh, rank: from_local(
            torch.zeros(4, 2).t(), mesh, [RaggedShard((0,), (1, 1))], shape=(4, 4)
        ),
        "must be contiguous",
    ),
    "non row-major stride": (
        lambda mesh, rank: from_local(
            torch.zeros(4),
            mesh,
            [RaggedShard((0,), (1, 1))],
            shape=torch.Size([4, 2]),
            stride=(1, 4),
        ),
        "needs a row-major tensor",
    ),
    "placements count != mesh dims": (
        lambda mesh, rank: distribute_tensor(
            torch.zeros(4, 2), mesh, [RaggedShard((0,), (1, 1)), Replicate()]
        ),
        "2 placements",
    ),
}


def _run_case(rank: int, world: int, name: str) -> str:
    mesh = init_device_mesh("cpu", (world,))
    fn, _ = CASES[name]
    try:
        fn(mesh, rank)
    except ValueError as exc:
        return str(exc)
    return "no ValueError"


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_raises_value_error_naming_the_problem(name: str) -> None:
    messages = run_threaded(_run_case, 2, name)
    _, expected = CASES[name]
    for rank, message in enumerate(messages):
        assert expected in message, f"rank {rank}: {message}"


def _mismatched_redistribute(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    # a local tensor that does not match its placement is caught before any collective
    bad = DTensor.from_local(torch.zeros(5), mesh, [Replicate()], run_check=False)
    placements: list[Placement] = [RaggedShard((0,), (1, 1))]
    spec_dt = from_local(torch.zeros(3), mesh, placements, shape=torch.Size([6]))
    object.__setattr__(spec_dt, "_local_tensor", bad.to_local())
    try:
        spec_dt.redistribute(mesh, [Shard(0)])
    except ValueError as exc:
        return str(exc)
    return "no ValueError"


def test_local_tensor_out_of_sync_with_units_is_detected_before_communicating() -> None:
    for message in run_threaded(_mismatched_redistribute, 2):
        assert "does not match" in message and "expected 3" in message, message


def _two_ragged_axes(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (2, 2))
    placements: list[Placement] = [RaggedShard((0,), (1, 1)), RaggedShard((0,), (1, 1))]
    try:
        from_local(torch.zeros(3), mesh, placements, shape=torch.Size([12]))
    except ValueError as exc:
        return str(exc)
    return "no ValueError"


def test_two_ragged_mesh_axes_are_rejected() -> None:
    for message in run_threaded(_two_ragged_axes, 4):
        assert "at most one mesh axis may be ragged" in message, message
