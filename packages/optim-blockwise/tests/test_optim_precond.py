"""Shampoo and SOAP: tiles, pieces, owners, roots, the block policy, sharded == one device.

Equality tests are of the *same arithmetic* kind: one thread set explicitly on every side
(``optim_precond_support.run``), the same data, the same ops in the same order on a fresh
contiguous copy of each tile, so they compare bit for bit.
"""

from __future__ import annotations

import itertools
import math
import os
import random
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_precond_support import check_equal_to_single, dist_run, run
from optim_support import ragged_spec, shard
from torch.distributed.device_mesh import init_device_mesh

import optim_blockwise as ob
from optim_blockwise._private import tiles as tl
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import DistributedFailure, run_processes, run_threaded

pytestmark = pytest.mark.numerics

# max_preconditioner_dim 16 below: several tiles per matrix, ragged last bands and columns.
SHAPES = [(40, 50), (7,), (33, 16), (16, 8), (1, 30), (3, 4, 5)]
PLAIN = [("plain",)] * len(SHAPES)
KWARGS: dict[str, dict[str, Any]] = {
    "shampoo": {
        "lr": 1e-2,
        "weight_decay": 0.1,
        "max_preconditioner_dim": 16,
        "precondition_frequency": 2,
        "start_preconditioning_step": 2,
    },
    "soap": {
        "lr": 1e-2,
        "weight_decay": 0.1,
        "max_preconditioner_dim": 16,
        "precondition_frequency": 2,
    },
}


# -- geometry ------------------------------------------------------------------------------


def test_tiles_cover_the_matrix_once() -> None:
    tiles = tl.tiles_of((40, 50), 16)
    assert [t.shape for t in tiles[:4]] == [(16, 16), (16, 16), (16, 16), (16, 2)]
    assert len(tiles) == 12 and tiles[-1] == tl.Tile(32, 40, 48, 50)
    covered = torch.zeros(40, 50, dtype=torch.int32)
    for t in tiles:
        covered[t.r0 : t.r1, t.c0 : t.c1] += 1
    assert bool((covered == 1).all())
    assert tl.matrix_shape((3, 4, 5)) == (3, 20) and tl.matrix_shape((7,)) is None


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "60")), deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 12),
    max_dim=st.integers(1, 7),
    world=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_property_pieces_tile_every_tile(
    rows: int, cols: int, max_dim: int, world: int, seed: int
) -> None:
    """For random flat layouts: each rank's piece of each tile, read from its local shard, is
    the tile's row-major range; the pieces concatenate to the tile; writing them back fills
    exactly the tile's elements of every shard."""
    rng = random.Random(seed)
    numel = rows * cols
    cuts = sorted(rng.randint(0, numel) for _ in range(world - 1))
    ranges = list(itertools.pairwise([0, *cuts, numel]))
    full = torch.arange(numel, dtype=torch.float64)
    matrix = full.view(rows, cols)
    written = [torch.zeros(hi - lo, dtype=torch.float64) for lo, hi in ranges]
    for tile in tl.tiles_of((rows, cols), max_dim):
        want = matrix[tile.r0 : tile.r1, tile.c0 : tile.c1].reshape(-1)
        tr = tl.tile_ranges(tile, cols, ranges)
        assert tr[0][0] == 0 and tr[-1][1] == tile.numel
        assert all(b == c for (_, b), (c, _) in itertools.pairwise(tr))
        parts = []
        for k, (lo, hi) in enumerate(ranges):
            piece = tl.piece_of(tile, cols, lo, *tr[k])
            got = tl.read_piece(full[lo:hi], piece, torch.float64)
            assert torch.equal(got, want[tr[k][0] : tr[k][1]])
            parts.append(got)
            tl.write_piece(written[k], piece, got + 1)
        assert torch.equal(torch.cat(parts), want)
    assert torch.equal(torch.cat(written), full + 1), "every element written exactly once"


def test_owners_keep_whole_tiles_and_balance_cut_ones() -> None:
    # tiles 0, 1 whole on ranks 1, 0; tiles 2-5 cut.
    costs = [100, 100, 50, 40, 30, 20]
    shares = [[0, 5], [5, 0], [2, 3], [4, 1], [1, 1], [3, 3]]
    owners = tl.assign_owners(costs, shares, 2)
    assert owners[:2] == (1, 0)
    loads = [sum(c for c, o in zip(costs, owners, strict=True) if o == k) for k in range(2)]
    assert abs(loads[0] - loads[1]) <= max(costs[2:]), loads
    assert owners == tl.assign_owners(costs, shares, 2), "deterministic"
    # ties go to the rank holding most of the tile
    assert tl.assign_owners([8], [[1, 3, 2]], 3) == (1,)


def test_block_policy_keeps_bands_whole_or_asks_nothing() -> None:
    policy = ob.Shampoo.block_policy(max_preconditioner_dim=16)
    assert policy == ob.PreconditionerBlockPolicy(16) == ob.SOAP.block_policy(16)
    assert policy("w", torch.empty(64, 50)) == 16 * 50  # bands of 16 rows divide 64
    assert policy("w", torch.empty(12, 50)) == 12 * 50  # one band: the whole matrix
    assert policy("w", torch.empty(40, 50)) == 1  # 40 = 16 + 16 + 8: no single block size
    assert policy("b", torch.empty(50)) == 1
    assert policy("c", torch.empty(32, 2, 3)) == 16 * 6
    with pytest.raises(ValueError, match="max_preconditioner_dim"):
        ob.PreconditionerBlockPolicy(0)


def test_block_policy_layout_makes_every_tile_whole() -> None:
    """Any layout whose rank boundaries fall on policy blocks holds every tile whole."""
    shape = (64, 50)
    block = ob.PreconditionerBlockPolicy(16)("w", torch.empty(shape))
    units = 64 * 50 // block
    for local_units in [(1, 3), (4, 0), (2, 1, 1), (0, 1, 0, 3)]:
        assert sum(local_units) == units
        placement = RaggedShard((0,), local_units)
        ranges = [
            (placement.flat_range(shape, k).start, placement.flat_range(shape, k).stop)
            for k in range(len(local_units))
        ]
        for tile in tl.tiles_of(shape, 16):
            shares = [b - a for a, b in tl.tile_ranges(tile, 50, ranges)]
            assert sorted(shares)[-1] == tile.numel, (local_units, tile, shares)


# -- roots -------------------------------------------------------------------------------------


def test_inverse_root_matches_float64_and_guards() -> None:
    gen = torch.Generator().manual_seed(0)
    g = torch.randn(12, 30, generator=gen, dtype=torch.float64)
    a = g @ g.T
    values, vectors = torch.linalg.eigh(a + 1e-6 * torch.eye(12, dtype=torch.float64))
    want = (vectors * values.pow(-0.25)) @ vectors.T
    got = ob.inverse_root(a.float(), 4.0, 1e-6)
    assert got is not None and got.dtype == torch.float32
    # Different arithmetic (fp32 vs fp64): eigh is backward stable, ||E|| <= n u ||A||; the
    # Frechet derivative of x^(-1/4) is bounded by 1/4 lambda_min^(-5/4), so
    # ||got - want||_2 <= n u ||A|| / 4 lambda_min^(-5/4) (plus the rounding of the result).
    u = 2.0**-24
    bound = 12 * u * float(values.max()) * 0.25 * float(values.min()) ** -1.25
    bound += 12 * u * float(torch.linalg.matrix_norm(want, 2))
    assert float(torch.linalg.matrix_norm(got.double() - want, 2)) <= bound
    wide = ob.inverse_root(a, 4.0, 1e-6, torch.float64)
    assert wide is not None and wide.dtype == torch.float64
    # A rank-deficient matrix: rounding gives eigenvalues below 0; clamped at epsilon: finite.
    low = ob.inverse_root(g[:2].T @ g[:2], 2.0, 1e-8)
    assert low is not None and bool(torch.isfinite(low).all())
    # Non-finite statistics: no root (fp32 and the fp64 retry fail): the caller keeps the old.
    assert ob.inverse_root(torch.full((3, 3), float("nan")), 4.0, 1e-6) is None


def test_failed_root_keeps_the_previous_one_and_counts() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 6))
    opt = ob.Shampoo([w], lr=0.1, precondition_frequency=1, start_preconditioning_step=1)
    w.grad = torch.randn(4, 6)
    opt.step()
    root = opt.state[w]["block0_L_inv_root"].clone()
    w.grad = torch.full((4, 6), float("inf"))
    opt.step()
    assert opt.last_step_stats["root_fallbacks"] == 2 and opt.root_fallbacks == 2
    assert torch.equal(opt.state[w]["block0_L_inv_root"], root)


def test_soap_non_finite_basis_keeps_the_previous_one_and_counts() -> None:
    """SOAP's guards, decided on the device: a first basis that is not finite is the identity
    (plain Adam on that side); a refreshed one that is not finite keeps the previous basis."""
    first = torch.nn.Parameter(torch.zeros(4, 6))
    opt = ob.SOAP([first], precondition_frequency=1)
    first.grad = torch.full((4, 6), float("nan"))
    opt.step()
    assert opt.root_fallbacks == 2 and opt.last_step_stats["root_fallbacks"] == 2
    for side, n in (("L", 4), ("R", 6)):
        basis = opt.state[first][f"block0_Q_{side}"]
        assert torch.equal(basis, torch.eye(n)) and basis.stride() == (1, n)  # column-major

    w = torch.nn.Parameter(torch.zeros(4, 6))
    opt = ob.SOAP([w], precondition_frequency=1)
    for _ in range(2):  # the first basis, then one refresh
        w.grad = torch.randn(4, 6)
        opt.step()
    kept = {side: opt.state[w][f"block0_Q_{side}"].clone() for side in "LR"}
    assert opt.root_fallbacks == 0
    w.grad = torch.full((4, 6), float("inf"))
    opt.step()
    assert opt.last_step_stats["root_fallbacks"] == 2 and opt.root_fallbacks == 2
    for side in "LR":
        assert torch.equal(opt.state[w][f"block0_Q_{side}"], kept[side]), side


def test_preconditioner_updates_every_frequency_steps() -> None:
    """Roots change only at steps start, start + f, start + 2f, ... (Shampoo); eigenbases at
    Adam steps f, 2f, ... (SOAP; step 1 takes the first basis)."""
    gen = torch.Generator().manual_seed(1)
    w = torch.nn.Parameter(torch.zeros(6, 5))
    v = torch.nn.Parameter(torch.zeros(6, 5))
    sh = ob.Shampoo([w], precondition_frequency=3, start_preconditioning_step=2)
    so = ob.SOAP([v], precondition_frequency=3)
    changed_root, changed_basis = [], []
    prev_root = prev_basis = None
    for step in range(1, 10):
        g = torch.randn(6, 5, generator=gen)
        w.grad, v.grad = g, g.clone()
        sh.step()
        so.step()
        root = sh.state[w]["block0_L_inv_root"].clone()
        basis = so.state[v]["block0_Q_L"].clone()
        if prev_root is not None and not torch.equal(root, prev_root):
            changed_root.append(step)
        if prev_basis is None or not torch.equal(basis, prev_basis):
            changed_basis.append(step)
        prev_root, prev_basis = root, basis
    assert changed_root == [2, 5, 8]
    assert changed_basis == [1, 4, 7]  # Adam steps k = step - 1 = 3, 6


def test_grafting_takes_the_direction_of_shampoo_and_the_size_of_the_graft() -> None:
    gen = torch.Generator().manual_seed(2)
    for grafting in ("adam", "sgd"):
        w = torch.nn.Parameter(torch.zeros(8, 12))
        opt = ob.Shampoo(
            [w],
            lr=1.0,
            betas=(0.0, 1.0),
            grafting=grafting,
            precondition_frequency=1,
            start_preconditioning_step=1,
            epsilon=1e-6,
        )
        g = torch.randn(8, 12, generator=gen, dtype=torch.float64)
        w.grad = g.float()
        opt.step()
        update = -w.detach().double()
        l_root = opt.state[w]["block0_L_inv_root"].double()
        r_root = opt.state[w]["block0_R_inv_root"].double()
        direction = l_root @ g @ r_root
        graft = g / (g.abs() + 1e-8) if grafting == "adam" else g  # Adam's first step: g/|g|
        cos = torch.nn.functional.cosine_similarity(update.flatten(), direction.flatten(), 0)
        assert float(cos) > 1 - 1e-5
        torch.testing.assert_close(
            torch.linalg.vector_norm(update), torch.linalg.vector_norm(graft), rtol=1e-5, atol=0
        )


# -- sharded == one device ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ragged_uneven_equals_single_device(kind: str, world: int) -> None:
    """Uneven element-granular RaggedShard layouts (zeros allowed), 6 steps: parameters,
    elementwise state and every tile's state bit-identical to one device."""
    specs = [ragged_spec(s, world, 1, seed=world * 7 + i) for i, s in enumerate(SHAPES)]
    per_rank = run_threaded(dist_run, world, kind, SHAPES, specs, 6, KWARGS[kind], timeout=120)
    single = run(None, kind, SHAPES, PLAIN, 6, KWARGS[kind])
    check_equal_to_single(per_rank, single, SHAPES, specs)
    assert any(s["exchanged_tiles"] for r in per_rank for s in r["stats"]), "cut tiles exchanged"


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_shard0_equals_single_device(kind: str, world: int) -> None:
    specs = [("chunk",)] * len(SHAPES)
    per_rank = run_threaded(dist_run, world, kind, SHAPES, specs, 5, KWARGS[kind], timeout=120)
    single = run(None, kind, SHAPES, PLAIN, 5, KWARGS[kind])
    check_equal_to_single(per_rank, single, SHAPES, specs)


def _gloo_cases(rank: int, world: int) -> bytes:
    from optim_support import to_bytes

    specs = [ragged_spec(s, world, 1, seed=world * 7 + i) for i, s in enumerate(SHAPES)]
    return to_bytes([dist_run(rank, world, k, SHAPES, specs, 4, KWARGS[k]) for k in KWARGS])


@pytest.mark.multiprocess
def test_gloo_processes_equal_single_device() -> None:
    """Real gloo processes, 4 ranks, uneven layouts with cut tiles: bit-identical."""
    from optim_support import from_bytes

    world = 4
    per_rank = [from_bytes(b) for b in run_processes(_gloo_cases, world, timeout=240)]
    specs = [ragged_spec(s, world, 1, seed=world * 7 + i) for i, s in enumerate(SHAPES)]
    for c, kind in enumerate(KWARGS):
        single = run(None, kind, SHAPES, PLAIN, 4, KWARGS[kind])
        check_equal_to_single([r[c] for r in per_rank], single, SHAPES, specs)
        assert any(s["exchanged_tiles"] for r in per_rank for s in r[c]["stats"])


def _policy_specs(shapes: list[tuple[int, ...]], world: int) -> list[tuple[Any, ...]]:
    policy = ob.PreconditionerBlockPolicy(16)
    specs = []
    for i, s in enumerate(shapes):
        block = policy("p", torch.empty(s))
        specs.append(ragged_spec(s, world, block, seed=i))
    return specs


def test_policy_layout_exchanges_nothing_and_equals_single_device() -> None:
    """Layouts cut only at the policy's blocks: every tile is computed where it lies, no
    collective at all, and the result is still the single-device one."""
    shapes = [(64, 50), (32, 16), (48, 3, 2), (7,)]
    world = 3
    specs = _policy_specs(shapes, world)
    kwargs = KWARGS["shampoo"]
    per_rank = run_threaded(dist_run, world, "shampoo", shapes, specs, 4, kwargs, timeout=120)
    single = run(None, "shampoo", shapes, [("plain",)] * len(shapes), 4, kwargs)
    check_equal_to_single(per_rank, single, shapes, specs)
    for r in per_rank:
        assert all(s["collectives"] == 0 and s["exchanged_tiles"] == 0 for s in r["stats"])
    assert sum(r["stats"][-1]["local_tiles"] for r in per_rank) == 4 * 4 + 2 + 3 * 1


def test_bf16_params_and_fp64_preconditioner_equal_single_device() -> None:
    kwargs = {**KWARGS["soap"], "preconditioner_dtype": torch.float64}
    specs = [ragged_spec(s, 3, 1, seed=i) for i, s in enumerate(SHAPES)]
    per_rank = run_threaded(dist_run, 3, "soap", SHAPES, specs, 4, kwargs, torch.bfloat16)
    single = run(None, "soap", SHAPES, PLAIN, 4, kwargs, torch.bfloat16)
    assert single["records"][0]["param"].dtype == torch.bfloat16
    assert single["records"][0]["block0_Q_L"].dtype == torch.float64
    assert single["records"][0]["block0_exp_avg"].dtype == torch.float32
    check_equal_to_single(per_rank, single, SHAPES, specs)


def _traffic(rank: int, world: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(64, 96), (96, 64), (32, 32)]
    params = [
        torch.nn.Parameter(shard(torch.randn(s), mesh, ragged_spec(s, world, 1, seed=i)))
        for i, s in enumerate(shapes)
    ]
    opt = ob.Shampoo(params, max_preconditioner_dim=32)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return dict(opt.last_step_stats)


def test_traffic_is_two_all_to_alls_within_twice_the_cut_tiles() -> None:
    out = run_threaded(_traffic, 4)
    # (64x96 + 96x64 + 32x32) fp32 is the most the cut tiles can weigh
    assert sum(o["bytes_sent"] for o in out) <= 2 * 4 * (2 * 64 * 96 + 32 * 32)
    assert all(o["collectives"] == 2 for o in out)  # one gather + one scatter (one bucket)
    assert sum(o["exchanged_tiles"] + o["local_tiles"] for o in out) == 6 + 6 + 1


def _disagree(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    params = [
        torch.nn.Parameter(shard(torch.randn(8, 8), mesh, ("chunk",))),
        torch.nn.Parameter(shard(torch.randn(9, 4), mesh, ("chunk",))),
    ]
    opt = ob.SOAP(params)
    params[0].grad = torch.zeros_like(params[0])
    if rank == 0:
        params[1].grad = torch.zeros_like(params[1])
    opt.step()


def test_ranks_disagreeing_on_grads_raise_instead_of_hanging() -> None:
    with pytest.raises(DistributedFailure, match="disagree"):
        run_threaded(_disagree, 2, timeout=30)


def _hsdp(rank: int, world: int, kind: str) -> list[torch.Tensor]:
    """2-D mesh (replicate x shard): RaggedShard on axis 1, Replicate on axis 0."""
    from torch.distributed.tensor import DTensor, Replicate

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    coord = mesh.get_local_rank(1)
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 50), (48,)]
    placements = [RaggedShard((0, 1), (777, 1223)), RaggedShard((0,), (1, 2))]

    def make(full: torch.Tensor, pl: RaggedShard) -> DTensor:
        r = pl.flat_range(full.shape, coord)
        local = full.reshape(-1)[r.start : r.stop].clone()
        return DTensor.from_local(
            local, mesh, [Replicate(), pl], shape=full.shape, stride=full.stride(), run_check=False
        )

    fulls = [torch.randn(s, generator=gen) for s in shapes]
    params = [torch.nn.Parameter(make(f, pl)) for f, pl in zip(fulls, placements, strict=True)]
    opt = (ob.Shampoo if kind == "shampoo" else ob.SOAP)(params, **KWARGS[kind])
    for _ in range(4):
        for p, s, pl in zip(params, shapes, placements, strict=True):
            p.grad = make(torch.randn(s, generator=gen), pl)
        opt.step()
    return [p.detach().to_local().clone() for p in params]


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_hsdp_two_dim_mesh_equals_single_device(kind: str) -> None:
    """Replicas compute identical results; the shard axis equals one device bit for bit."""
    out = run_threaded(_hsdp, 4, kind, timeout=120)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    shapes = [(40, 50), (48,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt = (ob.Shampoo if kind == "shampoo" else ob.SOAP)(params, **KWARGS[kind])
    for _ in range(4):
        for p, s in zip(params, shapes, strict=True):
            p.grad = torch.randn(s, generator=gen)
        opt.step()
    for rank in range(4):
        first = rank - rank % 2
        for i, p in enumerate(params):
            whole = torch.cat([out[first][i], out[first + 1][i]])
            assert torch.equal(whole, p.detach().reshape(-1)), f"rank {rank} param {i}"


def test_gradient_sharded_unlike_the_parameter_is_refused_by_name() -> None:
    with pytest.raises(DistributedFailure, match=r"'layer.w'.*sharded like the parameter"):
        run_threaded(_bad_grad, 2, timeout=30)


def _bad_grad(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    spec = ("ragged", (0, 1), (40, 8))  # rank 0: 40 elements, rank 1: 8; Shard(0) gives 24 each
    w = torch.nn.Parameter(shard(torch.randn(8, 6), mesh, spec))
    w.grad = shard(torch.randn(8, 6), mesh, ("chunk",))
    ob.Shampoo([{"params": [w], "param_names": ["layer.w"]}]).step()


# -- arguments -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "kwargs", "match"),
    [
        ("shampoo", {"lr": float("nan")}, "lr"),
        ("shampoo", {"betas": (0.9, 1.5)}, r"betas\[1\]"),
        ("shampoo", {"epsilon": 0.0}, "epsilon"),
        ("shampoo", {"grafting": "adagrad"}, "grafting"),
        ("shampoo", {"precondition_frequency": 0}, "precondition_frequency"),
        ("shampoo", {"start_preconditioning_step": 0}, "start_preconditioning_step"),
        ("shampoo", {"max_preconditioner_dim": 0}, "max_preconditioner_dim"),
        ("shampoo", {"preconditioner_dtype": torch.bfloat16}, "preconditioner_dtype"),
        ("soap", {"betas": (0.9, 1.0)}, "betas"),
        ("soap", {"shampoo_beta": 2.0}, "shampoo_beta"),
        ("soap", {"precondition_frequency": 1.5}, "precondition_frequency"),
    ],
)
def test_bad_arguments_name_the_argument(kind: str, kwargs: dict[str, Any], match: str) -> None:
    cls = ob.Shampoo if kind == "shampoo" else ob.SOAP
    with pytest.raises(ValueError, match=match):
        cls([torch.nn.Parameter(torch.zeros(2, 2))], **kwargs)


def test_use_preconditioner_true_rejects_vectors_by_name_and_sparse_grads() -> None:
    with pytest.raises(ValueError, match=r"'norm.weight'.*2 or more dims"):
        ob.SOAP(
            [
                {
                    "params": [torch.nn.Parameter(torch.zeros(4))],
                    "param_names": ["norm.weight"],
                    "use_preconditioner": True,
                }
            ]
        )
    emb = torch.nn.Embedding(10, 4, sparse=True)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        ob.Shampoo(emb.parameters()).step()


def test_use_preconditioner_false_is_the_graft_alone() -> None:
    """A matrix in a ``use_preconditioner=False`` group takes Adam grafting's update, which is
    Adam: equal to torch.optim.Adam within fp32 rounding (different op order)."""
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(6, 10, generator=gen)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ours = ob.Shampoo(
        [{"params": [a], "use_preconditioner": False}],
        lr=1e-2,
        betas=(0.9, 1.0),
        grafting_beta2=0.999,
        grafting_epsilon=1e-8,
    )
    ref = torch.optim.Adam([b], lr=1e-2, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(5):
        g = torch.randn(6, 10, generator=gen)
        a.grad, b.grad = g, g.clone()
        ours.step()
        ref.step()
    assert "block0_L" not in ours.state[a]
    # Adam's update is <= lr per element and its ops round to ~4 ulps of the update each step
    assert float((a - b).detach().abs().max()) <= 5 * 8 * 2.0**-24 * (1e-2 + float(w0.abs().max()))
    assert math.isfinite(float(a.detach().sum()))


def test_changing_max_preconditioner_dim_after_the_first_step_is_refused() -> None:
    w = torch.nn.Parameter(torch.zeros(8, 8))
    opt = ob.SOAP([{"params": [w], "param_names": ["w"]}], max_preconditioner_dim=8)
    w.grad = torch.ones(8, 8)
    opt.step()
    opt.param_groups[0]["max_preconditioner_dim"] = 4
    with pytest.raises(ValueError, match=r"'w': max_preconditioner_dim changed from 8 to 4"):
        opt.step()
