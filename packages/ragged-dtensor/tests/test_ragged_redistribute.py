"""Every redistribution to, from and between RaggedShard equals slicing the global tensor.

Breadth runs on torch's threaded process group (real collectives between threads, one process).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ragged_reference import reference_local, valid_units_total
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from ragged_dtensor import RaggedShard, StepKind, from_local, plan_redistribute
from ragged_dtensor.testing import count_collectives, run_threaded

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "120"))
pytestmark = pytest.mark.numerics


@st.composite
def ragged_placements(draw: st.DrawFn, shape: Sequence[int], world: int) -> RaggedShard:
    ndim = len(shape)
    k = draw(st.integers(0, ndim))
    dims = tuple(range(k))
    if not dims:
        root = draw(st.integers(0, world - 1))
        return RaggedShard((), tuple(1 if r == root else 0 for r in range(world)))
    total = draw(st.sampled_from(valid_units_total(shape, dims)))
    # a random composition of `total` into `world` parts, zeros allowed
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=world - 1, max_size=world - 1)))
    bounds = [0, *cuts, total]
    return RaggedShard(dims, tuple(bounds[i + 1] - bounds[i] for i in range(world)))


def _std(draw: st.DrawFn, ndim: int, *, partial: bool) -> Placement:
    options: list[Placement] = [Replicate()] + [Shard(d) for d in range(ndim)]
    if partial:
        options.append(Partial())
    return draw(st.sampled_from(options))


def _build(
    full: torch.Tensor,
    mesh_shape: tuple[int, ...],
    placements: Sequence[Placement],
    rank: int,
    mesh: object,
) -> DTensor:
    """A DTensor with exactly the reference local tensor (Partial: rank-scaled pieces)."""
    local = reference_local(
        full, mesh_shape, [p if not p.is_partial() else Replicate() for p in placements], rank
    )
    if any(p.is_partial() for p in placements):
        n = math.prod(mesh_shape[a] for a, p in enumerate(placements) if p.is_partial())
        local = local * 0 + local / n  # the sum over partial axes is the value
    return from_local(
        local,
        mesh,
        placements,
        shape=full.shape,  # type: ignore[arg-type]
        stride=full.stride(),
        run_check=False,
    )


def _check_redistribute(
    rank: int,
    world: int,
    mesh_shape: tuple[int, ...],
    src: tuple[Placement, ...],
    dst: tuple[Placement, ...],
    shape: tuple[int, ...],
) -> None:
    mesh = init_device_mesh("cpu", mesh_shape)
    full = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.5 + 1
    dt = _build(full, mesh_shape, src, rank, mesh)
    out = dt.redistribute(mesh, dst)
    expected = (
        reference_local(full, mesh_shape, dst, rank)
        if not any(p.is_partial() for p in dst)
        else None
    )
    assert out.placements == dst
    # Moves are exact; a Partial source holds x / n on each of n ranks (rounded once) and the
    # reduction sums n such pieces (n - 1 roundings): different arithmetic within
    # (n + 1) * eps64 * |x| (float64 data).
    n = math.prod(mesh_shape[a] for a, p in enumerate(src) if p.is_partial())
    largest = full.abs().max().item() if full.numel() else 0.0
    atol = (n + 1) * torch.finfo(torch.float64).eps * largest if n > 1 else 0.0
    if expected is not None:
        torch.testing.assert_close(
            out.to_local().reshape(-1), expected.reshape(-1), rtol=0, atol=atol
        )
    torch.testing.assert_close(out.full_tensor(), full, rtol=0, atol=atol)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_property_redistribute_1d_mesh(data: st.DataObject) -> None:
    world = data.draw(st.integers(1, 4), label="world")
    shape = tuple(data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=3), label="shape"))
    ragged = data.draw(ragged_placements(shape, world), label="ragged")
    other = data.draw(
        st.one_of(ragged_placements(shape, world), st.builds(lambda: None)), label="other"
    )
    std_src = _std(data.draw, len(shape), partial=True)
    std_dst = _std(data.draw, len(shape), partial=False)
    cases = [((ragged,), (std_dst,)), ((std_src,), (ragged,))]
    if other is not None:
        cases.append(((ragged,), (other,)))
    for src, dst in cases:
        run_threaded(_check_redistribute, world, (world,), src, dst, shape)


@settings(
    max_examples=max(10, EXAMPLES // 4), deadline=None, suppress_health_check=list(HealthCheck)
)
@given(data=st.data())
def test_property_redistribute_2d_mesh(data: st.DataObject) -> None:
    mesh_shape = (2, 2)
    shape = tuple(data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=3), label="shape"))
    ragged_axis = data.draw(st.integers(0, 1), label="axis")
    other_axis = 1 - ragged_axis
    # the ragged axis cuts X, the local tensor after the other axis' placement
    other_src = _std(data.draw, len(shape), partial=True)
    other_dst = _std(data.draw, len(shape), partial=False)
    x_src = reference_local(
        torch.empty(shape),
        (mesh_shape[other_axis],),
        [other_src if not other_src.is_partial() else Replicate()],
        0,
    ).shape
    x_dst = reference_local(torch.empty(shape), (mesh_shape[other_axis],), [other_dst], 0).shape
    # keep the ragged layout valid on every rank's X: use units that only depend on dims
    # with equal sizes across ranks (sizes differ only if the other axis splits unevenly)
    if any(
        x_src
        != reference_local(
            torch.empty(shape), (2,), [other_src if not other_src.is_partial() else Replicate()], r
        ).shape
        for r in range(2)
    ):
        return
    if any(
        x_dst != reference_local(torch.empty(shape), (2,), [other_dst], r).shape for r in range(2)
    ):
        return
    ragged_src = data.draw(ragged_placements(tuple(x_src), 2), label="ragged_src")
    ragged_dst = data.draw(ragged_placements(tuple(x_dst), 2), label="ragged_dst")
    src: list[Placement] = [Replicate(), Replicate()]
    dst: list[Placement] = [Replicate(), Replicate()]
    src[ragged_axis], src[other_axis] = ragged_src, other_src
    dst[ragged_axis], dst[other_axis] = ragged_dst, other_dst
    if not other_src.is_partial():
        run_threaded(_check_redistribute, 4, mesh_shape, tuple(src), tuple(dst), shape)
    std_dst: list[Placement] = [Replicate(), Replicate()]
    std_dst[other_axis] = other_dst
    std_dst[ragged_axis] = Replicate()
    if not other_src.is_partial():
        run_threaded(_check_redistribute, 4, mesh_shape, tuple(src), tuple(std_dst), shape)
    std_src = list(std_dst)
    std_src[other_axis] = other_src
    run_threaded(_check_redistribute, 4, mesh_shape, tuple(std_src), tuple(dst), shape)


def _count_body(rank: int, world: int) -> dict[str, dict[str, int]]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(48.0).reshape(12, 4)
    ragged = RaggedShard((0,), (1, 2, 0, 3)[:world] if world == 4 else (1, 2))
    other = RaggedShard((0, 1), (10, 10, 20, 8)[:world] if world == 4 else (5, 43))
    dt = from_local(
        reference_local(full, (world,), [ragged], rank),
        mesh,
        [ragged],
        shape=full.shape,
        run_check=False,
    )
    partial = DTensor.from_local(full.clone(), mesh, [Partial()], run_check=False)
    replicate = DTensor.from_local(full.clone(), mesh, [Replicate()], run_check=False)
    out: dict[str, dict[str, int]] = {}
    for name, fn in [
        ("ragged->replicate", dt.full_tensor),
        ("partial->ragged", lambda: partial.redistribute(mesh, [ragged])),
        ("ragged->ragged", lambda: dt.redistribute(mesh, [other])),
        ("ragged->shard0", lambda: dt.redistribute(mesh, [Shard(0)])),
        ("replicate->ragged", lambda: replicate.redistribute(mesh, [ragged])),
    ]:
        with count_collectives() as counter:
            fn()
        out[name] = dict(counter.calls)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_collective_counts(world: int) -> None:
    counts = run_threaded(_count_body, world)[0]
    assert counts["ragged->replicate"] == {"all_gather_single": 1}
    assert counts["partial->ragged"] == {"reduce_scatter_single": 1}
    assert counts["ragged->ragged"] == {"all_to_all_single": 1}
    assert counts["ragged->shard0"] == {"all_to_all_single": 1}
    assert counts["replicate->ragged"] == {}


def test_plan_is_pure_and_cached() -> None:
    src = (RaggedShard((0,), (1, 3)),)
    dst = (Replicate(),)
    a = plan_redistribute((2,), src, dst, (8, 2), (8, 2))
    b = plan_redistribute((2,), src, dst, (8, 2), (8, 2))
    assert a is b
    assert [s.kind for s in a] == [StepKind.GATHER]
    hsdp = plan_redistribute(
        (2, 2), (Partial(), Partial()), (Replicate(), RaggedShard((0,), (1, 1))), (8, 2), (8, 2)
    )
    # HSDP gradient sync: reduce-scatter of the full gradient, then all-reduce of the shard only
    assert [s.kind for s in hsdp] == [StepKind.REDUCE_SCATTER, StepKind.ALL_REDUCE]
