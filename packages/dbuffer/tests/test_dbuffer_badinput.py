"""Bad-input catalogue (layouts and buffers): the stated error type, a message naming the
offending tensor, argument or state."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.distributed.tensor import init_device_mesh

from dbuffer import DBuffer, contiguous_layout
from dbuffer.testing import load_full_
from ragged_dtensor.testing import expect_error_on_every_rank, run_threaded

SHAPES = [(2, 4), (4,)]
NAMES = ["layer.w", "layer.b"]


def _buffer(mesh: Any, **layout: Any) -> DBuffer:
    return DBuffer(contiguous_layout([8, 4], mesh.size(0), **layout), SHAPES, mesh, names=NAMES)


def _other_layout_add(mesh: Any) -> object:
    a = _buffer(mesh)
    b = _buffer(mesh, align=8)  # same tensors, other padding: other offsets and shard size
    return a.add_(b)


def _reduce_max(mesh: Any) -> object:
    buf = _buffer(mesh)
    buf.alloc_unsharded(zero=True)
    return buf.reduce_scatter(op="max")  # type: ignore[arg-type]


Case = tuple[Callable[[Any], object], type[Exception], tuple[str, ...]]
CASES: dict[str, Case] = {
    "layout: block does not divide numel": (
        lambda mesh: contiguous_layout([8, 4], 2, blocks=[3, 1]),
        ValueError,
        ("tensor 0", "block 3", "numel 8"),
    ),
    "layout: one block per tensor": (
        lambda mesh: contiguous_layout([8, 4], 2, blocks=[4]),
        ValueError,
        ("blocks has 1 entries for 2 tensors",),
    ),
    "layout: world size 0": (
        lambda mesh: contiguous_layout([8], 0),
        ValueError,
        ("world_size", "got 0"),
    ),
    "buffer: shape disagrees with the layout": (
        lambda mesh: DBuffer(contiguous_layout([8, 4], 2), [(3, 4), (4,)], mesh, names=NAMES),
        ValueError,
        ("'layer.w'", "(3, 4)", "12 elements", "gives it 8"),
    ),
    "buffer: layout for another world size": (
        lambda mesh: DBuffer(contiguous_layout([8, 4], 3), SHAPES, mesh, names=NAMES),
        ValueError,
        ("world_size 3", "2 ranks"),
    ),
    "buffer: not a layout": (
        lambda mesh: DBuffer(object(), SHAPES, mesh),  # type: ignore[arg-type]
        TypeError,
        ("object", "BufferLayout"),
    ),
    "buffer: shard axis not in the mesh": (
        lambda mesh: DBuffer(contiguous_layout([8, 4], 2), SHAPES, mesh, shard_axis=3),
        ValueError,
        ("shard_axis 3", "1-D mesh"),
    ),
    "load_full_: wrong numel": (
        lambda mesh: load_full_(_buffer(mesh), [torch.zeros(9), torch.zeros(4)]),
        ValueError,
        ("'layer.w'", "9 elements", "expects 8"),
    ),
    "load_full_: wrong dtype": (
        lambda mesh: load_full_(
            _buffer(mesh), [torch.zeros(8), torch.zeros(4, dtype=torch.float64)]
        ),
        ValueError,
        ("'layer.b'", "torch.float64", "torch.float32"),
    ),
    "full_views while released": (
        lambda mesh: _buffer(mesh).full_views(),
        RuntimeError,
        ("full_views", "released", "unshard()"),
    ),
    "reduce op": (_reduce_max, ValueError, ("'max'", "'sum' or 'avg'")),
    "group op: unknown part": (
        lambda mesh: _buffer(mesh).zero_(part="bogus"),  # type: ignore[arg-type]
        ValueError,
        ("part", "'bogus'"),
    ),
    "group op across layouts": (
        _other_layout_add,
        ValueError,
        ("DBuffer.add_", "different layout"),
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_names_the_offender(name: str) -> None:
    expect_error_on_every_rank(*CASES[name])


def _gather_as_int(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (world,))
    try:
        _buffer(mesh).unshard(dtype=torch.int32)
    except ValueError as exc:
        return f"ok: {exc}"
    return "no error"


def test_unshard_in_an_integer_dtype_is_rejected() -> None:
    """Found here, FAILS today: ``DBuffer.unshard(dtype=torch.int32)`` on a float buffer casts
    the shard to int and gathers it (values truncated, no error). The mixed-precision dtype of
    a floating buffer must be floating: raise ValueError naming it (buffer.py ``unshard``)."""
    for message in run_threaded(_gather_as_int, 2, timeout=60):
        assert message.startswith("ok: ") and "torch.int32" in message, message
