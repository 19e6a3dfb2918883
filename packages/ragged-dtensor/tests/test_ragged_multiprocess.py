"""Real gloo processes: collectives, autograd, a 2-D mesh and checkpoint across world sizes.

Each run has a hard timeout (``run_processes``), so a hang fails the test instead of CI.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ragged_reference import reference_local
from torch.distributed.tensor import DTensor, init_device_mesh
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from ragged_dtensor import RaggedShard, distribute_tensor, local_range
from ragged_dtensor.testing import count_collectives, run_processes

pytestmark = [pytest.mark.multiprocess, pytest.mark.numerics]


def _units(world: int) -> tuple[int, ...]:
    return (1, 3) if world == 2 else (0, 1, 2, 1)


def _collectives_and_autograd(rank: int, world: int) -> dict[str, int]:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    full = torch.randn(8, 6, generator=gen)
    p = RaggedShard((0,), _units(world))
    q = RaggedShard((0, 1), tuple(reversed([u * 6 for u in _units(world)])))
    d = distribute_tensor(full, mesh, [p])
    assert torch.equal(d.to_local(), reference_local(full, (world,), [p], rank))
    assert local_range(d).numel == d.to_local().numel()
    counts: dict[str, int] = {}
    with count_collectives() as c:
        assert torch.equal(d.full_tensor(), full)
    counts["gather"] = c.total
    with count_collectives() as c:
        moved = d.redistribute(mesh, [q])
    counts["ragged_to_ragged"] = c.total
    assert torch.equal(moved.to_local(), reference_local(full, (world,), [q], rank))
    for target in ([Shard(0)], [Shard(1)], [Replicate()]):
        there = d.redistribute(mesh, target)
        assert torch.equal(there.full_tensor(), full)
        assert torch.equal(there.redistribute(mesh, [p]).to_local(), d.to_local())
    partial = DTensor.from_local(full * (rank + 1), mesh, [Partial()], run_check=False)
    with count_collectives() as c:
        reduced = partial.redistribute(mesh, [p])
    counts["reduce_scatter"] = c.total
    scale = world * (world + 1) / 2
    # different arithmetic: sum_k (k + 1) * x in gloo's order vs x * scale: each of the world
    # terms and adds rounds once, relative to |x| * scale
    eps = torch.finfo(full.dtype).eps
    torch.testing.assert_close(
        reduced.to_local(),
        reference_local(full * scale, (world,), [p], rank),
        rtol=0,
        atol=(2 * world + 1) * eps * scale * full.abs().max().item(),
    )
    # autograd: gather forward, slice backward; a loss on the full tensor
    x = distribute_tensor(full, mesh, [p]).requires_grad_()
    with count_collectives() as c:
        loss = (x.full_tensor() ** 2).sum()
        loss.backward()
    counts["autograd"] = c.total
    assert x.grad is not None
    # same arithmetic: the gradient of sum(y ** 2) is 2 * y, sliced (bitwise)
    assert torch.equal(x.grad.to_local(), reference_local(2 * full, (world,), [p], rank))
    return counts


@pytest.mark.parametrize(
    "world",
    [pytest.param(2, marks=pytest.mark.slow), 4],  # CI budget: 4 ranks cover 2's paths
)
def test_collectives_and_autograd_on_gloo(world: int) -> None:
    counts = run_processes(_collectives_and_autograd, world, timeout=120)
    assert all(
        c == {"gather": 1, "ragged_to_ragged": 1, "reduce_scatter": 1, "autograd": 1}
        for c in counts
    ), counts


def _two_d_mesh(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(12, 8, generator=gen)
    # RaggedShard on dp cuts the local TP shard (12 x 4): units of 2 rows
    p = RaggedShard((0,), (1, 5))
    placements = (p, Shard(1))
    d = distribute_tensor(full, mesh, placements)
    assert torch.equal(d.to_local(), reference_local(full, (2, 2), placements, rank))
    assert torch.equal(d.full_tensor(), full)
    # change only the ragged axis, then both axes
    q = RaggedShard((0, 1), (40, 8))
    assert torch.equal(
        d.redistribute(mesh, (q, Shard(1))).to_local(),
        reference_local(full, (2, 2), (q, Shard(1)), rank),
    )
    assert torch.equal(d.redistribute(mesh, (Shard(0), Replicate())).full_tensor(), full)
    # HSDP-style gradient sync: (Partial, Partial) -> (Replicate, RaggedShard)
    hsdp = (Replicate(), RaggedShard((0,), (1, 2)))
    grad = DTensor.from_local(full.clone(), mesh, [Partial(), Partial()], run_check=False)
    with count_collectives() as c:
        synced = grad.redistribute(mesh, hsdp)
    assert c.calls == {"reduce_scatter_single": 1, "all_reduce": 1}, c.calls
    # same arithmetic: x + x = 2x and 2x + 2x = 4x are exact (a reduce-scatter of 2, then an
    # all-reduce of 2): bitwise
    assert torch.equal(synced.to_local(), reference_local(full * 4, (2, 2), hsdp, rank))
    # elementwise ops and a norm on the 2-D ragged layout; the norm's partial sums are combined
    # in another order: different arithmetic, relative (n + 2) * eps for n non-negative terms
    torch.testing.assert_close(
        torch.linalg.vector_norm(d * 2).full_tensor(),
        torch.linalg.vector_norm(full * 2),
        rtol=(full.numel() + 2) * torch.finfo(full.dtype).eps,
        atol=0,
    )


def test_two_d_mesh_dp_ragged_tp_shard() -> None:
    run_processes(_two_d_mesh, 4, timeout=120)


def _save(rank: int, world: int, path: str) -> None:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(7, 5, 3, generator=gen), torch.randn(10, 4, generator=gen)
    units_a = (2, 5) if world == 2 else (0, 3, 1, 3)
    state = {
        # element-granular units: shares are not boxes, written as several chunks
        "a": distribute_tensor(a, mesh, [RaggedShard((0, 1), units_a)]),
        # a Muon-style root holding the whole tensor
        "b": distribute_tensor(b, mesh, [RaggedShard((), (0,) * (world - 1) + (1,))]),
    }
    dcp.save(state, checkpoint_id=path)


def _load(rank: int, world: int, path: str) -> list[str]:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(7, 5, 3, generator=gen), torch.randn(10, 4, generator=gen)
    checked = []
    targets = {
        "ragged": (
            [RaggedShard((0,), (3, 4) if world == 2 else (1, 2, 2, 2))],
            [RaggedShard((0,), (5, 5) if world == 2 else (4, 0, 3, 3))],
        ),
        "shard": ([Shard(1)], [Shard(0)]),
        "replicate": ([Replicate()], [Replicate()]),
    }
    for name, (pa, pb) in targets.items():
        state = {
            "a": distribute_tensor(torch.zeros(7, 5, 3), mesh, pa),
            "b": distribute_tensor(torch.zeros(10, 4), mesh, pb),
        }
        dcp.load(state, checkpoint_id=path)
        assert torch.equal(state["a"].full_tensor(), a), name
        assert torch.equal(state["b"].full_tensor(), b), name
        checked.append(name)
    return checked


# (4, 2): CI budget, in `nox -s slow`; (2, 4) and the threaded reshard tests stay in CI
@pytest.mark.parametrize(
    ("save_world", "load_world"), [(2, 4), pytest.param(4, 2, marks=pytest.mark.slow)]
)
def test_checkpoint_reshards_across_world_sizes(
    tmp_path: Path, save_world: int, load_world: int
) -> None:
    run_processes(_save, save_world, str(tmp_path), timeout=120)
    loaded = run_processes(_load, load_world, str(tmp_path), timeout=120)
    assert all(names == ["ragged", "shard", "replicate"] for names in loaded)
