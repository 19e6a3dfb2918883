"""AdamW8bit: against torch's AdamW, memory, state_dict, policies, and sharded == single device.

Numerics: against torch's AdamW, different arithmetic with the bounds stated per test; sharded
against single device, same arithmetic (elementwise on whole blocks, threaded ranks in this
process): bitwise.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from optim_support import (
    UNALIGNED,
    assert_records_equal,
    check_against_single,
    dist_run_flat_steps,
    dist_run_steps,
    ragged_spec,
    run_flat_steps,
    run_steps,
)

import optim_blockwise as ob
from ragged_dtensor.testing import run_threaded

pytestmark = [pytest.mark.numerics, pytest.mark.filterwarnings(UNALIGNED)]

SHAPES = [(64, 96), (40, 50), (7,), (128, 33), (1, 4096)]
PLAIN = [("plain",)] * len(SHAPES)


def _pair(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.nn.Parameter, torch.nn.Parameter]:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return torch.nn.Parameter(w.clone()), torch.nn.Parameter(w.clone())


def test_fp32_state_path_matches_torch_adamw() -> None:
    """Different arithmetic: below min_8bit_size the moments stay fp32 and the update is AdamW's
    in another operation order. Each step may round the update and the parameter differently by
    a few ulps (8 allowed): over 10 steps rtol = 10 * 8 * eps32 = 9.5e-6 of |p|, and, for entries
    near zero, atol = 10 * 8 * eps32 * lr (|update| <= lr)."""
    steps, lr, eps32 = 10, 1e-2, torch.finfo(torch.float32).eps
    a, b = _pair((30, 40))
    ours = ob.AdamW8bit([a], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        g = torch.randn(a.shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert ours.state[a]["exp_avg"].dtype == torch.float32
    torch.testing.assert_close(a, b, rtol=steps * 8 * eps32, atol=steps * 8 * eps32 * lr)


def test_8bit_tracks_torch_adamw() -> None:
    """Different arithmetic by design (8-bit states): the dynamic map's relative step is <= ~2%
    for the moments' range, so the 8-bit path stays within 5% of AdamW's (not a float bound:
    independent of the CPU's kernels)."""
    a, b = _pair((128, 256))
    ours = ob.AdamW8bit([a], lr=1e-3)
    ref = torch.optim.AdamW([b], lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    w0 = a.detach().clone()
    for _ in range(20):
        g = torch.randn(a.shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert ours.state[a]["exp_avg_codes"].dtype == torch.uint8
    moved = (b.detach() - w0).norm()
    assert float((a.detach() - b.detach()).norm() / moved) < 0.05, "within 5% of AdamW's path"
    m = ob.dequantize_blockwise(
        ours.state[a]["exp_avg_codes"], ours.state[a]["exp_avg_absmax"], 256, signed=True
    )
    ref_m = ref.state[b]["exp_avg"].reshape(-1)
    assert float((m - ref_m).norm() / ref_m.norm()) < 0.05


def test_state_bytes_per_parameter() -> None:
    """8-bit state <= 2.1 bytes/param including absmaxes, vs 8 for torch's AdamW."""
    shape = (512, 512)
    a, b = _pair(shape)
    ours, ref = ob.AdamW8bit([a], block_size=256), torch.optim.AdamW([b])
    a.grad, b.grad = torch.ones(shape), torch.ones(shape)
    ours.step()
    ref.step()

    def state_bytes(opt: torch.optim.Optimizer, p: torch.Tensor) -> int:
        return sum(
            v.numel() * v.element_size()
            for k, v in opt.state[p].items()
            if isinstance(v, torch.Tensor) and k != "step"
        )

    per_param_ours = state_bytes(ours, a) / a.numel()
    per_param_ref = state_bytes(ref, b) / b.numel()
    assert per_param_ours == pytest.approx(2 + 8 / 256)
    assert per_param_ours <= 2.1
    assert per_param_ref == 8.0


def test_decision_uses_global_numel_and_is_configurable() -> None:
    small, big = torch.nn.Parameter(torch.zeros(4095)), torch.nn.Parameter(torch.zeros(4096))
    opt = ob.AdamW8bit([small, big])
    small.grad, big.grad = torch.ones(4095), torch.ones(4096)
    opt.step()
    assert "exp_avg" in opt.state[small] and "exp_avg_codes" in opt.state[big]
    p = torch.nn.Parameter(torch.zeros(100))
    opt = ob.AdamW8bit([p], min_8bit_size=0, block_size=64)
    p.grad = torch.ones(100)
    opt.step()
    assert opt.state[p]["exp_avg_absmax"].numel() == 2


def test_state_dict_round_trip_continues_bit_identically() -> None:
    shapes = [(64, 96), (10,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = ob.AdamW8bit(params, lr=1e-2)
    gen = torch.Generator().manual_seed(3)
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(6)]
    for step in range(3):
        for p, g in zip(params, grads[step], strict=True):
            p.grad = g
        opt.step()
    saved = opt.state_dict()
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = ob.AdamW8bit(clones, lr=1.0)
    opt2.load_state_dict(saved)
    assert opt2.param_groups[0]["lr"] == 1e-2
    for key, value in opt.state[params[0]].items():
        assert opt2.state[clones[0]][key].dtype == value.dtype, key
    for step in range(3, 6):
        for p, q, g in zip(params, clones, grads[step], strict=True):
            p.grad, q.grad = g, g.clone()
        opt.step()
        opt2.step()
    for p, q in zip(params, clones, strict=True):
        assert torch.equal(p, q)


def test_bf16_params_keep_fp32_state_through_state_dict() -> None:
    p = torch.nn.Parameter(torch.randn(64, 128).bfloat16())
    opt = ob.AdamW8bit([p])
    p.grad = torch.randn(64, 128).bfloat16()
    opt.step()
    assert p.dtype == torch.bfloat16
    absmax = opt.state[p]["exp_avg_absmax"].clone()
    opt.load_state_dict(opt.state_dict())
    assert opt.state[p]["exp_avg_absmax"].dtype == torch.float32
    assert torch.equal(opt.state[p]["exp_avg_absmax"], absmax)
    assert opt.state[p]["exp_avg_codes"].dtype == torch.uint8


def test_non_finite_gradient_behaves_like_adamw_and_poisons_the_block() -> None:
    """Documented: NaN grads propagate to that element's param (as torch AdamW); the 8-bit
    state of the whole block becomes NaN, which spreads to the block on the next step."""
    a, b = _pair((64, 128))
    ours, ref = ob.AdamW8bit([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2)
    g = torch.randn(64, 128)
    g[0, 5] = float("nan")
    a.grad, b.grad = g.clone(), g.clone()
    ours.step()
    ref.step()
    assert torch.equal(torch.isnan(a), torch.isnan(b)), "same elements NaN as AdamW on that step"
    assert math.isnan(float(ours.state[a]["exp_avg_absmax"][0]))
    assert math.isfinite(float(ours.state[a]["exp_avg_absmax"][1]))
    a.grad = torch.randn(64, 128)
    ours.step()
    assert torch.isnan(a.detach().reshape(-1)[:256]).all()
    assert torch.isfinite(a.detach().reshape(-1)[256:]).all(), "other blocks are unaffected"


def test_block_policy() -> None:
    policy = ob.AdamW8bit.block_policy(block_size=256)
    assert policy == ob.adamw8bit_block_policy(256)
    assert policy("w", torch.empty(64, 128)) == 256
    assert policy("bias", torch.empty(100)) == 1, "fp32-state tensors need no alignment"
    odd = torch.empty(4097)
    assert policy("odd", odd) == 1, "short last block: gcd(4097, 256), never the whole tensor"
    assert policy("emb", torch.empty(103, 64)) == 64, "gcd(6592, 256): spread over the ranks"
    for shape in [(64, 128), (100,), (4097,), (4096, 3)]:
        t = torch.empty(shape)
        assert t.numel() % policy("x", t) == 0
    assert ob.Muon.block_policy()("w", torch.empty(8, 16)) == 1
    assert ob.muon_block_policy(row_aligned=True)("w", torch.empty(8, 16)) == 16


def test_bad_input_errors_name_the_problem() -> None:
    with pytest.raises(ValueError, match="block_size"):
        ob.AdamW8bit([torch.nn.Parameter(torch.zeros(3))], block_size=0)
    with pytest.raises(ValueError, match="betas"):
        ob.AdamW8bit([torch.nn.Parameter(torch.zeros(3))], betas=(1.0, 0.9))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("unit", [256, 32, 1], ids=["aligned", "unit32", "elementwise"])
def test_ragged_shards_bit_identical_to_single_device(world: int, unit: int) -> None:
    """Block-aligned shards (unit 256) issue no collective; unaligned ones exchange edge
    absmaxes; both give single-device states and params bit for bit, over 5 steps."""
    specs = [
        ragged_spec(s, world, unit if math.prod(s) % unit == 0 else 1, seed=world * 7 + i)
        for i, s in enumerate(SHAPES)
    ]
    kwargs = {"lr": 1e-2, "weight_decay": 0.05, "block_size": 256}
    results = run_threaded(dist_run_steps, world, "adamw8bit", SHAPES, specs, 5, kwargs)
    single = run_steps(None, "adamw8bit", SHAPES, PLAIN, 5, kwargs)
    check_against_single(results, single, SHAPES, specs, 256)


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_shard0_bit_identical_to_single_device(world: int) -> None:
    specs = [("chunk",)] * len(SHAPES)
    kwargs = {"lr": 1e-2, "block_size": 128}
    results = run_threaded(dist_run_steps, world, "adamw8bit", SHAPES, specs, 5, kwargs)
    single = run_steps(None, "adamw8bit", SHAPES, PLAIN, 5, kwargs)
    check_against_single(results, single, SHAPES, specs, 128)


def test_bf16_ragged_bit_identical() -> None:
    specs = [ragged_spec(s, 3, 1, seed=i) for i, s in enumerate(SHAPES)]
    kwargs = {"lr": 1e-2}
    results = run_threaded(dist_run_steps, 3, "adamw8bit", SHAPES, specs, 5, kwargs, torch.bfloat16)
    single = run_steps(None, "adamw8bit", SHAPES, PLAIN, 5, kwargs, torch.bfloat16)
    check_against_single(results, single, SHAPES, specs, 256)


def _three_steps(rank: int, world: int, aligned: bool) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    shapes = [(64, 96)]
    # seed 5: the unit-32 split puts a boundary inside a 256-block
    specs = [ragged_spec(shapes[0], world, 256 if aligned else 32, seed=5)]
    run_steps(mesh, "adamw8bit", shapes, specs, 3, {"block_size": 256})


def test_aligned_shards_issue_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    import torch.distributed as dist

    calls: list[int] = []
    lock = threading.Lock()

    def counting(original: Any) -> Any:
        def wrapper(*args: object, **kwargs: object) -> object:
            with lock:
                calls.append(1)
            return original(*args, **kwargs)

        return wrapper

    # the edge exchange is an all_gather; the fingerprint check (ragged_dtensor's shared
    # agreement check) an all_gather_single
    for name in ("all_gather", "all_gather_single"):
        monkeypatch.setattr(dist, name, counting(getattr(dist, name)))
    run_threaded(_three_steps, 2, True)
    assert calls == []
    # Unaligned: per rank, one fingerprint all-gather when the layout is first seen (not per
    # step: issue 24 defect 8), and one batched edge all-gather per step.
    run_threaded(_three_steps, 2, False)
    assert len(calls) == (1 + 3) * 2


def _shard1(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)]))
    opt = ob.AdamW8bit([{"params": [p], "param_names": ["layer.weight"]}])
    p.grad = distribute_tensor(torch.randn(8, 8), mesh, [Shard(1)])
    try:
        opt.step()
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_unsupported_placement_is_rejected_by_name() -> None:
    messages = run_threaded(_shard1, 2)
    assert all("'layer.weight'" in m and "Shard(dim=1)" in m for m in messages), messages[0]


@pytest.mark.parametrize("units", [(0, 3, 5), (3, 0, 5), (3, 5, 0)])
def test_empty_shards_with_unaligned_blocks(units: tuple[int, ...]) -> None:
    shapes = [(50, 96)]  # 4800 elements, units of 600: every boundary cuts a 256-block
    specs = [("ragged", (0, 1), units)]
    kwargs = {"lr": 1e-2, "block_size": 256}
    results = run_threaded(dist_run_steps, 3, "adamw8bit", shapes, specs, 3, kwargs)
    single = run_steps(None, "adamw8bit", shapes, [("plain",)], 3, kwargs)
    check_against_single(results, single, shapes, specs, 256)


def _disagree(rank: int, world: int) -> None:
    from optim_support import shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    spec = ("ragged", (0, 1), (3, 5))
    params = [torch.nn.Parameter(shard(torch.randn(50, 96), mesh, spec)) for _ in range(2)]
    opt = ob.AdamW8bit(params)
    params[0].grad = torch.zeros_like(params[0])
    if rank == 0:
        params[1].grad = torch.zeros_like(params[1])
    opt.step()


def test_ranks_disagreeing_on_grads_raise_instead_of_aborting() -> None:
    from ragged_dtensor.testing import DistributedFailure

    with pytest.raises(DistributedFailure, match="AdamW8bit: ranks of a process group disagree"):
        run_threaded(_disagree, 2, timeout=30)


def _gradient_missing(rank: int, world: int, where: str) -> list[torch.Tensor]:
    """Two 8-bit parameters on shards that cut blocks; in step 3 the second has no gradient
    (on rank 0 only, or on every rank)."""
    from optim_support import shard
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    spec = ("ragged", (0, 1), (3, 5) if world == 2 else (8,))
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(shard(torch.randn(50, 96, generator=gen), mesh, spec))]
    params.append(torch.nn.Parameter(shard(torch.randn(50, 96, generator=gen), mesh, spec)))
    opt = ob.AdamW8bit([{"params": params, "param_names": ["a", "b"]}], lr=1e-2)
    for step in range(4):
        for p in params:
            p.grad = shard(torch.randn(50, 96, generator=gen), mesh, spec)
        if step == 2 and (where == "everywhere" or rank == 0):
            params[1].grad = None
        opt.step()
    return [p.detach().to_local().clone() for p in params]


def test_gradient_missing_on_one_rank_in_a_later_step_raises_on_every_rank() -> None:
    """The exchange was agreed on in step 1; in step 3 rank 0 has no gradient for 'b': its
    presence flag travels with the edge absmaxes and every rank raises, naming it."""
    from ragged_dtensor.testing import DistributedFailure

    with pytest.raises(DistributedFailure, match=r"AdamW8bit: ranks .* disagree.*mixed: \['b'\]"):
        run_threaded(_gradient_missing, 2, "one rank", timeout=30)


def test_gradient_missing_on_every_rank_skips_the_parameter_like_one_device() -> None:
    out = run_threaded(_gradient_missing, 2, "everywhere", timeout=30)
    (single,) = run_threaded(_gradient_missing, 1, "everywhere", timeout=30)
    for i in range(2):
        assert torch.equal(torch.cat([o[i] for o in out]), single[i]), i


# -- flat runs, bounded memory, kernels ---------------------------------------------------------

FLAT_SHAPES = [(64, 96), (40, 64), (96,), (128, 32), (4096 + 256 * 3 + 17,), (32, 48), (1, 4096)]


def _aligned_spec(shape: tuple[int, ...], world: int, seed: int) -> tuple[Any, ...]:
    """RaggedShard over all dims with shares on 256-blocks where numel allows (block policy)."""
    numel = math.prod(shape)
    unit = 256 if numel % 256 == 0 else 1
    return ragged_spec(shape, world, unit, seed=seed)


@pytest.mark.parametrize("world", [2, 3])
def test_flat_storage_runs_bit_identical_to_single_device(world: int) -> None:
    """Parameters and gradients that are views of one storage (as fully_shard makes them): the
    update runs on flat runs of consecutive parameters, in chunks, and every parameter, code and
    absmax equals the single-device optimizer bit for bit over 5 steps (same arithmetic, 1
    thread on both sides). Short last blocks (4096 + 785 elements), fp32-state tensors in
    between, and empty shares included."""
    specs = [_aligned_spec(s, world, world * 13 + i) for i, s in enumerate(FLAT_SHAPES)]
    kwargs = {"lr": 1e-2, "weight_decay": 0.05, "block_size": 256}
    results = run_threaded(dist_run_flat_steps, world, "adamw8bit", FLAT_SHAPES, specs, 5, kwargs)
    single = run_steps(None, "adamw8bit", FLAT_SHAPES, [("plain",)] * len(FLAT_SHAPES), 5, kwargs)
    check_against_single([r["records"] for r in results], single, FLAT_SHAPES, specs, 256)
    for r in results:
        assert r["stats"]["runs"] < len(FLAT_SHAPES), r["stats"]


def test_flat_storage_single_device_equals_separate_tensors() -> None:
    """On one device, parameters viewing one storage (runs, several chunks each; a run ends
    where the state kind changes or a short last block ends the grid) and separate tensors
    (runs of one) give the same bits."""
    kwargs = {"lr": 1e-2, "block_size": 256}
    flat = run_flat_steps(None, "adamw8bit", FLAT_SHAPES, [("plain",)] * 7, 5, kwargs)
    single = run_steps(None, "adamw8bit", FLAT_SHAPES, [("plain",)] * 7, 5, kwargs)
    # [8-bit] [fp32, fp32] [8-bit, 8-bit ending in a short block] [fp32] [8-bit]
    assert flat["stats"]["runs"] == 5 and flat["stats"]["chunks"] > 5, flat["stats"]
    for got, want in zip(flat["records"], single, strict=True):
        assert_records_equal(got, want, "flat vs separate")


def _step_allocations(opt: torch.optim.Optimizer) -> int:
    """Peak bytes allocated inside one ``opt.step()`` beyond what existed before it: the sum of
    the profiler's raw allocation events in time order (exact; sees kernel temporaries)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        opt.step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def test_step_transient_memory_is_at_most_4_bytes_per_element() -> None:
    """Beyond the stored state, ``step()`` allocates at most 4 bytes per parameter element
    (measured: every allocation, kernel temporaries included), for tensors in one storage and
    for separate ones, against ~40 bytes per element for whole-tensor dequantize/quantize."""
    from optim_support import flat_views, one_thread

    gen = torch.Generator().manual_seed(0)
    shapes = [(512, 512), (256, 1024), (1024, 300), (300, 301), (4096,), (2048, 64)]
    numel = sum(math.prod(s) for s in shapes)
    with one_thread():
        for flat in (True, False):
            fulls = [torch.randn(s, generator=gen) for s in shapes]
            tensors = flat_views(fulls, None, [("plain",)] * 6) if flat else fulls
            params = [torch.nn.Parameter(t) for t in tensors]
            opt = ob.AdamW8bit(params, lr=1e-3)
            for step in range(3):
                grads = [torch.randn(s, generator=gen) for s in shapes]
                for p, g in zip(params, flat_views(grads, None, [("plain",)] * 6), strict=True):
                    p.grad = g
                if step < 2:
                    opt.step()  # the state exists after the first step
                    continue
                per_element = _step_allocations(opt) / numel
                assert per_element <= 4.0, (flat, per_element)


def _kernels_per_parameter(flat: bool) -> float:
    from optim_support import flat_views, one_thread
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            count[0] += 1
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(0)
    shapes = [(64,)] + [(64, 64)] * 48 + [(64,)] * 3  # MoE-like: 48 expert matrices, 4 norms
    with one_thread():
        fulls = [torch.randn(s, generator=gen) for s in shapes]
        specs = [("plain",)] * len(shapes)
        tensors = flat_views(fulls, None, specs) if flat else fulls
        params = [torch.nn.Parameter(t) for t in tensors]
        opt = ob.AdamW8bit(params, min_8bit_size=4096)
        for step in range(2):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            for p, g in zip(params, flat_views(grads, None, specs) if flat else grads, strict=True):
                p.grad = g
            if step == 1:
                with Count():
                    opt.step()
            else:
                opt.step()
    return count[0] / len(shapes)


def test_fewer_kernels_per_parameter_on_flat_storage() -> None:
    """Ops dispatched per parameter in a step (every aten op, views included): consecutive
    parameters in one storage share one run's kernels (here 52 parameters in 3 runs: a norm,
    48 expert matrices with 8-bit state in chunks, 3 norms), against ~80 per parameter for
    parameters each in its own storage."""
    flat, separate = _kernels_per_parameter(True), _kernels_per_parameter(False)
    assert flat < separate / 4, (flat, separate)
