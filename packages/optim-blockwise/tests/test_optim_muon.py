"""Muon: Newton-Schulz, lr conventions, roots, AdamW path, and distributed == single device.

Numerics: against torch's Muon, different arithmetic with the bounds stated per test; sharded
against single device, same arithmetic (each whole matrix orthogonalized once, threaded ranks in
this process): bitwise.
"""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from optim_support import (
    UNALIGNED,
    check_against_single,
    dist_run_steps,
    ragged_spec,
    run_steps,
    shard,
)
from torch.distributed.device_mesh import init_device_mesh

import optim_blockwise as ob
from ragged_dtensor.testing import DistributedFailure, run_threaded

pytestmark = [pytest.mark.numerics, pytest.mark.filterwarnings(UNALIGNED)]

SHAPES = [(64, 96), (40, 50), (7,), (128, 33), (16, 8), (1, 30)]
PLAIN = [("plain",)] * len(SHAPES)


def test_newton_schulz_matches_torch_reference_bitwise() -> None:
    from torch.optim._muon import _zeropower_via_newtonschulz

    gen = torch.Generator().manual_seed(0)
    for shape in [(32, 64), (64, 32), (17, 17)]:
        g = torch.randn(shape, generator=gen)
        ref = _zeropower_via_newtonschulz(g, ob.DEFAULT_NS_COEFFICIENTS, 5, 1e-7)
        assert torch.equal(ob.newton_schulz(g), ref)


def test_newton_schulz_orthogonalizes() -> None:
    g = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    o = ob.newton_schulz(g, dtype=torch.float32)
    singular = torch.linalg.svdvals(o)
    # The quintic coefficients trade exactness for speed: singular values land in ~[0.7, 1.2].
    assert float(singular.min()) > 0.6 and float(singular.max()) < 1.25
    # Same singular vectors as the input's polar factor.
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    assert float(torch.nn.functional.cosine_similarity(o.flatten(), (u @ vh).flatten(), 0)) > 0.95
    assert ob.newton_schulz(g.T, dtype=torch.float32).shape == (256, 64)


def test_adjust_lr_conventions() -> None:
    assert ob.adjust_lr(0.1, "original", (400, 100)) == pytest.approx(0.2)
    assert ob.adjust_lr(0.1, "original", (100, 400)) == pytest.approx(0.1)
    assert ob.adjust_lr(0.1, "match_rms_adamw", (100, 400)) == pytest.approx(0.1 * 0.2 * 20)
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        ob.adjust_lr(0.1, "bogus", (1, 1))


def test_ns_flops_and_roots_balance() -> None:
    assert ob.ns_flops((64, 128)) == 5 * (4 * 64 * 64 * 128 + 2 * 64**3)
    assert ob.ns_flops((128, 64)) == ob.ns_flops((64, 128))
    costs = [100, 90, 50, 40, 30, 20, 10, 5]
    shares = [[1, 1, 1]] * len(costs)
    roots = ob.assign_roots(costs, shares)
    assert roots == ob.assign_roots(costs, shares), "deterministic"
    loads = [sum(c for c, r in zip(costs, roots, strict=True) if r == k) for k in range(3)]
    assert max(loads) - min(loads) <= max(costs), "greedy LPT bound"
    assert sorted(loads) == [110, 115, 120]
    # Ties go to the rank already holding most of the matrix (less traffic).
    assert ob.assign_roots([7], [[0, 5, 9]]) == (2,)


@pytest.mark.parametrize("adjust", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_single_device_matches_torch_muon(adjust: str, nesterov: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 80, generator=gen)
    a, b = torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())
    kw: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "nesterov": nesterov}
    ours = ob.Muon([a], adjust_lr_fn=adjust, ns_dtype=torch.float32, **kw)
    ref = torch.optim.Muon([b], adjust_lr_fn=adjust, **kw)
    ours_bf16 = torch.nn.Parameter(w.clone())
    ob16 = ob.Muon([ours_bf16], adjust_lr_fn=adjust, **kw)
    for _ in range(6):
        g = torch.randn(w.shape, generator=gen)
        a.grad, b.grad, ours_bf16.grad = g.clone(), g.clone(), g.clone()
        ours.step()
        ref.step()
        ob16.step()
    # Different arithmetic, tolerances from the NS precision (not the CPU's kernels): torch's
    # reference runs NS in bf16 (2-3% accurate against fp64); ours in fp32 for this comparison.
    moved = float((b.detach() - w).abs().max())
    assert float((a.detach() - b.detach()).abs().max()) < 0.05 * moved
    # Our bf16 NS is torch's op for op: equal up to the momentum's last-bit rounding.
    assert float((ours_bf16.detach() - b.detach()).abs().max()) < 0.01 * moved
    # The momentum is elementwise in another operation order: <= 2 ulps per step over 6 steps,
    # relative to |m| <= max|g| (randn: < 6).
    eps32 = torch.finfo(torch.float32).eps
    torch.testing.assert_close(
        ours.state[a]["momentum_buffer"].view(w.shape),
        ref.state[b]["momentum_buffer"],
        rtol=6 * 2 * eps32,
        atol=6 * 2 * eps32 * 6.0,
    )


def test_adamw_path_for_non_matrices_and_groups() -> None:
    w = torch.nn.Parameter(torch.randn(16, 32))
    bias = torch.nn.Parameter(torch.randn(32))
    emb = torch.nn.Parameter(torch.randn(50, 16))
    ref_bias = torch.nn.Parameter(bias.detach().clone())
    ref_emb = torch.nn.Parameter(emb.detach().clone())
    opt = ob.Muon(
        [{"params": [w, bias]}, {"params": [emb], "use_muon": False}], lr=1e-2, weight_decay=0.0
    )
    ref = torch.optim.AdamW([ref_bias, ref_emb], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    for _ in range(4):
        for p, q in ((bias, ref_bias), (emb, ref_emb)):
            g = torch.randn(p.shape)
            p.grad, q.grad = g, g.clone()
        w.grad = torch.randn(w.shape)
        opt.step()
        ref.step()
    assert "momentum_buffer" in opt.state[w]
    assert "exp_avg" in opt.state[bias] and "exp_avg" in opt.state[emb]
    # Different arithmetic (AdamW in another operation order): a few ulps (8 allowed) of |p|
    # per step, over 4 steps; near zero, of the update (<= lr).
    tol = 4 * 8 * torch.finfo(torch.float32).eps
    torch.testing.assert_close(bias, ref_bias, rtol=tol, atol=tol * 1e-2)
    torch.testing.assert_close(emb, ref_emb, rtol=tol, atol=tol * 1e-2)


def test_use_muon_true_rejects_non_matrices_by_name() -> None:
    with pytest.raises(ValueError, match=r"'norm.weight'.*2-D"):
        ob.Muon(
            [
                {
                    "params": [torch.nn.Parameter(torch.zeros(4))],
                    "param_names": ["norm.weight"],
                    "use_muon": True,
                }
            ]
        )


def test_state_dict_round_trip() -> None:
    params = [torch.nn.Parameter(torch.randn(16, 24)), torch.nn.Parameter(torch.randn(24))]
    opt = ob.Muon(params, lr=1e-2)
    grads = [[torch.randn(p.shape) for p in params] for _ in range(4)]
    for p, g in zip(params, grads[0], strict=True):
        p.grad = g
    opt.step()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = ob.Muon(clones, lr=5.0)
    opt2.load_state_dict(opt.state_dict())
    for step in range(1, 4):
        for p, q, g in zip(params, clones, grads[step], strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
    for p, q in zip(params, clones, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("unit", [1, 8], ids=["elementwise", "unit8"])
def test_ragged_distributed_equals_single_device(
    world: int, unit: int, ns_dtype: torch.dtype
) -> None:
    """Every matrix orthogonalized once on its root; over 6 steps the params and momenta equal
    the single-device run (bit for bit here: same data, same ops, CPU)."""
    specs = [
        ragged_spec(s, world, unit if math.prod(s) % unit == 0 else 1, seed=world * 11 + i)
        for i, s in enumerate(SHAPES)
    ]
    kwargs = {"lr": 2e-2, "ns_dtype": ns_dtype, "adjust_lr_fn": "match_rms_adamw"}
    results = run_threaded(dist_run_steps, world, "muon", SHAPES, specs, 6, kwargs)
    single = run_steps(None, "muon", SHAPES, PLAIN, 6, kwargs)
    check_against_single(results, single, SHAPES, specs, 1)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_shard0_distributed_equals_single_device(world: int) -> None:
    specs = [("chunk",)] * len(SHAPES)
    kwargs = {"lr": 2e-2, "ns_dtype": torch.float32}
    results = run_threaded(dist_run_steps, world, "muon", SHAPES, specs, 5, kwargs)
    single = run_steps(None, "muon", SHAPES, PLAIN, 5, kwargs)
    check_against_single(results, single, SHAPES, specs, 1)


EXPERT_SHAPES = [(6, 16, 24), (4, 40, 12), (64, 48), (3, 1, 30)]


@pytest.mark.parametrize("ns_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_expert_weights_sharded_equal_single_device(world: int, ns_dtype: torch.dtype) -> None:
    """3-D expert weights under ragged layouts that cut experts anywhere, groups of experts
    spread over the owners (one batched NS per group), tiny buckets: 5 steps bit-identical to
    one device (same arithmetic: every world size batches the same experts together, 1 thread
    on both sides)."""
    specs = [ragged_spec(s, world, 1, seed=world * 5 + i) for i, s in enumerate(EXPERT_SHAPES)]
    kwargs = {
        "lr": 2e-2,
        "ns_dtype": ns_dtype,
        "bucket_cap_mb": 0.004,
        "expert_group_flops": 2**19,  # groups of 3 (and shorter last groups) over the owners
    }
    results = run_threaded(dist_run_steps, world, "muon", EXPERT_SHAPES, specs, 5, kwargs)
    single = run_steps(None, "muon", EXPERT_SHAPES, [("plain",)] * 4, 5, kwargs)
    check_against_single(results, single, EXPERT_SHAPES, specs, 1)


def test_expert_weights_equal_separate_matrices() -> None:
    """On one device a 3-D ``(E, m, n)`` parameter is E matrices: each expert ends where E
    separate 2-D parameters stepped by the same Muon end (its own NS and norm, its own lr
    scale). Different arithmetic: batched vs single GEMMs sum in different orders. In float64
    (parameters and NS), with the momentum bit-identical (elementwise, same ops), the only
    difference is the NS rounding: per step at most ``lr' * 15 GEMMs * K * a^steps * 2^-53``
    (K = 24 the inner dimension, a = 3.4445 the NS iteration's largest slope, 5 steps), so
    after 4 steps ``|dW| <= 4 * lr' * 15 * 24 * 3.4445**5 * 2**-53``."""
    from optim_support import one_thread

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(5, 24, 16, generator=gen, dtype=torch.float64)
    stacked = torch.nn.Parameter(w.clone())
    separate = [torch.nn.Parameter(w[e].clone()) for e in range(5)]
    lr = 0.02
    kw: dict[str, Any] = {"lr": lr, "ns_dtype": torch.float64, "adjust_lr_fn": "original"}
    a, b = ob.Muon([stacked], **kw), ob.Muon(separate, **kw)
    with one_thread():
        for _ in range(4):
            g = torch.randn(w.shape, generator=gen, dtype=torch.float64)
            stacked.grad = g.clone()
            for e, p in enumerate(separate):
                p.grad = g[e].clone()
            a.step()
            b.step()
    scaled = ob.adjust_lr(lr, "original", (24, 16))
    bound = 4 * scaled * 15 * 24 * 3.4445**5 * 2.0**-53
    moved = float((stacked.detach() - w).abs().max())
    assert moved > 1e3 * bound, "the test moves the weights far more than the bound"
    for e, p in enumerate(separate):
        assert float((stacked.detach()[e] - p.detach()).abs().max()) <= bound, e
        buf = a.state[stacked]["momentum_buffer"].view(5, -1)[e]
        assert torch.equal(buf, b.state[p]["momentum_buffer"]), "momentum: same arithmetic"


def _expert_owners(rank: int, world: int) -> list[tuple[int, int, int]]:
    """(item, first expert, owner) of every unit of the plan: one (12, 32, 48) expert weight in
    groups of 3 experts (4 equal units), beside a 2-D matrix, on ragged shards."""
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(12, 32, 48), (40, 24)]
    params = [
        torch.nn.Parameter(shard(torch.randn(s), mesh, ragged_spec(s, world, 1, seed=7 + i)))
        for i, s in enumerate(shapes)
    ]
    flops = 3 * ob.ns_flops((32, 48), 5)
    opt = ob.Muon(params, ns_dtype=torch.float32, expert_group_flops=flops)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    plan = opt._plans[0]
    assert plan.exchange is not None
    owners = plan.exchange.plan.owners
    return [(u.item, u.expert, owner) for u, owner in zip(plan.units, owners, strict=True)]


def test_expert_groups_of_one_weight_are_spread_over_owners() -> None:
    """A 3-D weight is not one root's job: its 4 equal expert groups land on 4 different
    owners at world size 4 (flops and root memory balanced), the same plan on every rank."""
    out = run_threaded(_expert_owners, 4)
    assert all(o == out[0] for o in out), "every rank plans the same owners"
    experts = [(e, owner) for item, e, owner in out[0] if item == 0]
    assert [e for e, _ in experts] == [0, 3, 6, 9], experts
    assert len({owner for _, owner in experts}) == 4, experts


@pytest.mark.parametrize("world", [3, 4])
def test_many_buckets_equal_single_device(world: int) -> None:
    """Buckets of ~4 KB (one or two matrices each), three gathers in flight: the pipeline
    changes the schedule, never the values."""
    specs = [ragged_spec(s, world, 1, seed=world + i) for i, s in enumerate(SHAPES)]
    kwargs = {"lr": 2e-2, "ns_dtype": torch.float32, "bucket_cap_mb": 0.004, "in_flight": 3}
    results = run_threaded(dist_run_steps, world, "muon", SHAPES, specs, 4, kwargs)
    single = run_steps(None, "muon", SHAPES, PLAIN, 4, kwargs)
    check_against_single(results, single, SHAPES, specs, 1)


def test_owners_balance_flops_and_root_memory() -> None:
    """Two costs balanced at once: square matrices heavy in flops, long thin ones in memory.
    Balancing flops alone piles the memory on some ranks; the 2-D balance keeps both within
    the largest unit of the optimum."""
    from optim_blockwise._private.owners import assign_owners

    shapes = [(384, 384)] * 2 + [(32, 8192)] * 5 + [(256, 256)] * 3
    costs = [(ob.ns_flops(s), ob.ns_root_bytes(s)) for s in shapes]
    shares = [[1, 1, 1, 1]] * len(shapes)
    owners = assign_owners(costs, shares)
    assert owners == assign_owners(costs, shares), "deterministic"
    for d in range(2):
        loads = [sum(c[d] for c, o in zip(costs, owners, strict=True) if o == k) for k in range(4)]
        ideal = sum(c[d] for c in costs) / 4
        assert max(loads) <= ideal + max(c[d] for c in costs), (d, loads)
    flops_only = ob.assign_roots([c[0] for c in costs], shares)
    mem = [sum(c[1] for c, o in zip(costs, flops_only, strict=True) if o == k) for k in range(4)]
    mem2 = [sum(c[1] for c, o in zip(costs, owners, strict=True) if o == k) for k in range(4)]
    assert max(mem2) < max(mem), (mem2, mem)


def _traffic(rank: int, world: int, cap: float) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(64, 96), (96, 64), (32, 32), (128, 16), (6, 16, 24)]
    params = [
        torch.nn.Parameter(shard(torch.randn(s), mesh, ragged_spec(s, world, 1, seed=i)))
        for i, s in enumerate(shapes)
    ]
    opt = ob.Muon(params, ns_dtype=torch.float32, bucket_cap_mb=cap)
    stats = []
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
        stats.append(dict(opt.last_step_stats))
    return {
        "stats": stats,
        "plans": opt.plans_made,
        "buckets": len(opt._plans[0].exchange.plan.buckets),  # type: ignore[union-attr]
        "momentum_bytes": sum(4 * math.prod(s) for s in shapes),
    }


@pytest.mark.parametrize("cap", [64.0, 0.02], ids=["one-bucket", "buckets"])
def test_traffic_is_two_all_to_alls_per_bucket_and_at_most_twice_the_momentum(cap: float) -> None:
    """Steady state: one gather and one scatter all-to-all per bucket, no agreement collective
    (the plan is made and agreed on once), and each matrix crosses the network at most once
    each way (plus 16 bytes of presence flags per destination and bucket)."""
    world = 4
    out = run_threaded(_traffic, world, cap)
    buckets = out[0]["buckets"]
    assert (buckets == 1) == (cap > 1)
    for step in range(3):
        total_sent = sum(o["stats"][step]["bytes_sent"] for o in out)
        flags = 2 * world * (world - 1) * 16 * buckets
        assert total_sent <= 2 * out[0]["momentum_bytes"] + flags
    for o in out:
        assert o["plans"] == 1
        assert all(s["collectives"] == 2 * buckets for s in o["stats"])


def _missing_grad(rank: int, world: int, mode: str) -> list[torch.Tensor]:
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = [(24, 40), (40, 24), (3, 8, 12)]
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    mesh_or_none = mesh if world > 1 else None
    specs = [
        ragged_spec(s, world, 1, seed=i) if world > 1 else ("plain",) for i, s in enumerate(shapes)
    ]
    params = [
        torch.nn.Parameter(shard(f, mesh_or_none, sp)) for f, sp in zip(fulls, specs, strict=True)
    ]
    opt = ob.Muon(params, lr=0.02, ns_dtype=torch.float32, bucket_cap_mb=0.001)
    for step in range(4):
        for p, s, sp in zip(params, shapes, specs, strict=True):
            p.grad = shard(torch.randn(s, generator=gen), mesh_or_none, sp)
        if step == 2 and (mode == "everywhere" or rank == 0):
            params[1].grad = None
        opt.step()
    return [(p.to_local() if world > 1 else p).detach().reshape(-1).clone() for p in params]


def test_gradient_missing_on_one_rank_in_a_later_step_raises_on_every_rank() -> None:
    """The plan was agreed on at step 1; at step 3 rank 0 has no gradient for one matrix: the
    presence flags inside the exchange raise on every rank, naming it, instead of applying an
    update made from a partial gradient (or hanging)."""
    with pytest.raises(DistributedFailure, match=r"disagree.*mixed: .*\]\[1\] \(shape \(40, 24"):
        run_threaded(_missing_grad, 2, "one rank", timeout=60)


def test_gradient_missing_on_every_rank_skips_the_matrix_like_one_device() -> None:
    """A gradient that is None on every rank: the matrix is not stepped (no momentum, decay or
    update), as on one device; the exchange sizes do not change."""
    out = run_threaded(_missing_grad, 3, "everywhere")
    (single,) = run_threaded(_missing_grad, 1, "everywhere")
    for i in range(3):
        whole = torch.cat([o[i] for o in out])
        assert torch.equal(whole, single[i]), i


def _disagree(rank: int, world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    params = [
        torch.nn.Parameter(shard(torch.randn(8, 8), mesh, ("chunk",))),
        torch.nn.Parameter(shard(torch.randn(8, 4), mesh, ("chunk",))),
    ]
    opt = ob.Muon(params)
    params[0].grad = torch.zeros_like(params[0])
    if rank == 0:  # only rank 0 has a gradient for the second matrix
        params[1].grad = torch.zeros_like(params[1])
    opt.step()


def test_ranks_disagreeing_on_grads_raise_instead_of_hanging() -> None:
    with pytest.raises(DistributedFailure, match="disagree"):
        run_threaded(_disagree, 2, timeout=30)


def _hsdp(rank: int, world: int, kind: str) -> list[torch.Tensor]:
    """2-D mesh (replicate x shard): RaggedShard on axis 1, Replicate on axis 0."""
    from torch.distributed.tensor import DTensor, Replicate

    from ragged_dtensor import RaggedShard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    coord = mesh.get_local_rank(1)
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 48), (48,)]
    placements = [RaggedShard((0, 1), (5, 7)), RaggedShard((0,), (1, 2))]
    fulls = [torch.randn(s, generator=gen) for s in shapes]

    def make(full: torch.Tensor, pl: RaggedShard) -> DTensor:
        r = pl.flat_range(full.shape, coord)
        return DTensor.from_local(
            full.reshape(-1)[r.start : r.stop].clone(),
            mesh,
            [Replicate(), pl],
            shape=full.shape,
            stride=full.stride(),
            run_check=False,
        )

    params = [torch.nn.Parameter(make(f, pl)) for f, pl in zip(fulls, placements, strict=True)]
    opt: torch.optim.Optimizer
    if kind == "muon":
        opt = ob.Muon(params, lr=0.02, ns_dtype=torch.float32)
    else:
        opt = ob.AdamW8bit(params, lr=0.01, min_8bit_size=0, block_size=16)
    for _ in range(5):
        for p, s, pl in zip(params, shapes, placements, strict=True):
            p.grad = make(torch.randn(s, generator=gen), pl)
        opt.step()
    return [p.detach().to_local().clone() for p in params]


@pytest.mark.parametrize("kind", ["muon", "adamw8bit"])
def test_hsdp_two_dim_mesh_equals_single_device(kind: str) -> None:
    out = run_threaded(_hsdp, 4, kind)
    gen = torch.Generator().manual_seed(0)
    shapes = [(32, 48), (48,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    opt: torch.optim.Optimizer
    if kind == "muon":
        opt = ob.Muon(params, lr=0.02, ns_dtype=torch.float32)
    else:
        opt = ob.AdamW8bit(params, lr=0.01, min_8bit_size=0, block_size=16)
    for _ in range(5):
        for p, s in zip(params, shapes, strict=True):
            p.grad = torch.randn(s, generator=gen)
        opt.step()
    for rank, locals_ in enumerate(out):
        # ranks 0,1 and 2,3 are the two replicas; coordinate on the shard axis = rank % 2
        first = rank - rank % 2
        for i, p in enumerate(params):
            whole = torch.cat([out[first][i], out[first + 1][i]])
            assert torch.equal(whole, p.detach().reshape(-1)), f"replica of rank {rank}"
            assert torch.equal(locals_[i], out[rank % 2][i]), "replicas agree"


def _sharded_state_dict_round_trip(rank: int, world: int, kind: str) -> bool:
    from optim_support import make_optimizer

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(64, 96), (33,)]
    specs = [ragged_spec(s, world, 1, seed=i) for i, s in enumerate(shapes)]
    gen = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    kwargs: dict[str, Any] = {"lr": 0.01}
    if kind == "adamw8bit":
        kwargs["block_size"] = 64
    params = [torch.nn.Parameter(shard(f, mesh, sp)) for f, sp in zip(fulls, specs, strict=True)]
    opt = make_optimizer(kind, params, kwargs)
    for step in range(2):
        for p, g, sp in zip(params, grads[step], specs, strict=True):
            p.grad = shard(g, mesh, sp)
        opt.step()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make_optimizer(kind, clones, kwargs)
    opt2.load_state_dict(opt.state_dict())
    for step in range(2, 4):
        for p, q, g, sp in zip(params, clones, grads[step], specs, strict=True):
            p.grad, q.grad = shard(g, mesh, sp), shard(g, mesh, sp)
        opt.step()
        opt2.step()
    return all(torch.equal(p.to_local(), q.to_local()) for p, q in zip(params, clones, strict=True))


@pytest.mark.parametrize("kind", ["muon", "adamw8bit"])
def test_sharded_state_dict_round_trip(kind: str) -> None:
    assert run_threaded(_sharded_state_dict_round_trip, 3, kind) == [True] * 3


@settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", "40")), deadline=None)
@given(
    world=st.integers(1, 6),
    sizes=st.lists(st.integers(0, 40), min_size=1, max_size=8),
    buckets=st.integers(1, 4),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_property_exchange_round_trip(
    world: int, sizes: list[int], buckets: int, seed: int, dtype: torch.dtype
) -> None:
    """Simulated all-to-alls (no process group): in every bucket every owner assembles exactly
    its units with the right presence status, and scattering results back gives every rank
    exactly its pieces and every unit's status."""
    import itertools
    import random

    from optim_blockwise._private import exchange
    from optim_blockwise._private.owners import assign_owners

    rng = random.Random(seed)
    ranges = []
    for n in sizes:
        cuts = sorted(rng.randint(0, n) for _ in range(world - 1))
        ranges.append(tuple(itertools.pairwise([0, *cuts, n])))
    costs = [(rng.randint(0, 9), n) for n in sizes]
    owners = assign_owners(costs, [[hi - lo for lo, hi in r] for r in ranges])
    mats = [(torch.arange(n) + 100 * i).to(dtype) for i, n in enumerate(sizes)]
    present = [[rng.random() < 0.8 for _ in sizes] for _ in range(world)]
    want_status = [
        [1 if all(p[i] for p in present) else 0 if not any(p[i] for p in present) else 2]
        for i in range(len(sizes))
    ]
    plans = [exchange.plan_exchange(k, ranges, owners, buckets=buckets) for k in range(world)]
    assert sorted(i for b in plans[0].buckets for i in b.units) == list(range(len(sizes)))
    size = mats[0].element_size()

    def route(sends: list[torch.Tensor], out: list[list[int]], inp: list[list[int]]) -> list:
        chunks = [list(torch.split(sends[k], inp[k])) for k in range(world)]
        recvs = [torch.cat([chunks[k][d] for k in range(world)]) for d in range(world)]
        for d in range(world):
            assert recvs[d].numel() == sum(out[d])
        return recvs

    for b in range(len(plans[0].buckets)):
        lays = [exchange.BucketLayout(p, p.buckets[b], size, True) for p in plans]
        sends = [
            lay.pack_gather(
                {i: mats[i][slice(*ranges[i][k])] for i in lay.bucket.units},
                present[k],
                torch.device("cpu"),
            )
            for k, lay in enumerate(lays)
        ]
        recvs = route(sends, [lay.gather_recv for lay in lays], [lay.gather_send for lay in lays])
        backs = []
        for d, lay in enumerate(lays):
            fulls, status = lay.unpack_gather(recvs[d], dtype)
            assert sorted(fulls) == sorted(lay.mine)
            for j, i in enumerate(lay.mine):
                assert owners[i] == d and torch.equal(fulls[i], mats[i])
                assert status is not None and int(status[j]) == want_status[i][0]
            results = {i: fulls[i] * 2 for i in lay.mine}
            backs.append(lay.pack_scatter(results, status, torch.device("cpu")))
        got = route(backs, [lay.scatter_recv for lay in lays], [lay.scatter_send for lay in lays])
        for k, lay in enumerate(lays):
            pieces, statuses = lay.unpack_scatter(got[k], dtype)
            assert statuses is not None
            for j, i in enumerate(lay.bucket.units):
                assert torch.equal(pieces[i], mats[i][slice(*ranges[i][k])] * 2)
                assert int(statuses[j]) == want_status[i][0]


def test_bf16_params_distributed_equals_single_device() -> None:
    specs = [ragged_spec(s, 3, 1, seed=i) for i, s in enumerate(SHAPES)]
    kwargs = {"lr": 2e-2}
    results = run_threaded(dist_run_steps, 3, "muon", SHAPES, specs, 5, kwargs, torch.bfloat16)
    single = run_steps(None, "muon", SHAPES, PLAIN, 5, kwargs, torch.bfloat16)
    assert single[0]["param"].dtype == torch.bfloat16
    assert single[0]["momentum_buffer"].dtype == torch.float32
    check_against_single(results, single, SHAPES, specs, 1)
