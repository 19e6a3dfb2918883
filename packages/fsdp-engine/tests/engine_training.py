"""Training loops shared by the parity tests: ours, torch FSDP2, the single-process references
(and the checks that compare them).

[Note: the two kinds of numeric comparison]
- *Same arithmetic* (compared bitwise): ``reference_per_rank`` runs, in one process, exactly the
  floating-point operations of the sharded run: each rank's micro-batch forward/backward (same
  shapes, same kernels), the per-rank gradients summed in the order the process group sums them,
  then scaled by ``1 / world`` (what ``dbuffer``'s reduce-scatter does after a sum), then the same
  elementwise optimizer. Torch's FSDP2 on the same script is the same arithmetic too (its gloo
  pre/post-divide factors are powers of two for these world sizes, so they commute exactly with
  the sum). Both sides run with one intra-op thread (``torch.set_num_threads(1)`` here and in
  every rank), because the thread count changes the order of a kernel's internal reductions.
- *Different arithmetic* (a derived tolerance): ``reference`` computes the whole global batch at
  once, so every sum over the batch is reassociated. Those tests run in float64, where a
  reassociated sum of n terms is off by at most about ``n * eps64`` relative (eps64 = 2.2e-16); see
  ``FP64_TOLERANCE``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from engine_models import RNG_LOCK, TinyLlama, batches, build, loss_fn
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
}


_INIT_CACHE: dict[int, dict[str, torch.Tensor]] = {}


def initial_state(seed: int = 0) -> dict[str, torch.Tensor]:
    """The same initial weights for every rank. Threaded ranks share torch's global generator,
    so the weights are made once, under a lock, and copied."""
    with RNG_LOCK:
        if seed not in _INIT_CACHE:
            with torch.random.fork_rng():
                torch.manual_seed(seed)
                _INIT_CACHE[seed] = {k: v.clone() for k, v in TinyLlama().state_dict().items()}
        return {k: v.clone() for k, v in _INIT_CACHE[seed].items()}


# float64, 10 steps, at most ~10^4 terms per reassociated sum: each step's gradients differ by
# <= ~1e4 * eps64 = 2e-12 relative; we allow 1e-9 (a growth of 500x over the steps, which AdamW's
# normalised updates and SGD's lr 0.5 stay far below: measured ~1e-15). A sharding bug (a wrong
# shard, a missing, doubled or unaveraged gradient) moves parameters by >= lr * 1e-2 = 1e-4.
FP64_TOLERANCE = 1e-9


def _built(dtype: torch.dtype) -> TinyLlama:
    model = build().to(dtype)
    model.load_state_dict(initial_state())
    return model


def reference(
    steps: int,
    world: int,
    optimizer: str = "adamw",
    micro: int = 1,
    dtype: torch.dtype = torch.float64,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process, the whole global batch per step (different arithmetic: reassociated
    batch sums; compare with ``FP64_TOLERANCE`` in float64)."""
    model = _built(dtype)
    opt = OPTIMIZERS[optimizer](model.parameters())
    losses = []
    data = batches(steps * micro, world)
    for step in range(steps):
        total = 0.0
        for m in range(micro):
            loss = loss_fn(model, data[step * micro + m]) / micro
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_per_rank(
    steps: int,
    world: int,
    optimizer: str = "adamw",
    micro: int = 1,
    mesh_shape: tuple[int, ...] | None = None,
) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The sharded run's arithmetic in one process (same arithmetic: compare bitwise).

    Returns each rank's local losses and the final parameters. Per step and rank: the rank's
    micro-batches accumulate into a fresh gradient (autograd's in-place add, as into the engine's
    pre-zeroed buffer); the ranks' gradients are summed in the threaded process group's order (rank
    order within the shard axis, then across replicas for HSDP) and scaled by ``1 / world``; then
    the optimizer steps on whole tensors (elementwise, so the same per element as on shards).
    """
    model = _built(torch.float32)
    params = list(model.parameters())
    opt = OPTIMIZERS[optimizer](params)
    data = batches(steps * micro, world)
    shard = (mesh_shape or (world,))[-1]
    losses: list[list[float]] = [[] for _ in range(world)]
    for step in range(steps):
        grads = []
        for rank in range(world):
            for p in params:
                p.grad = None
            total = torch.zeros((), dtype=torch.float64)  # as train_sharded sums them
            for m in range(micro):
                loss = loss_fn(model, data[step * micro + m].chunk(world)[rank]) / micro
                loss.backward()
                total += loss.detach().double()
            losses[rank].append(total.item())
            grads.append([p.grad.clone() for p in params])  # type: ignore[union-attr]
        for i, p in enumerate(params):
            per_replica = []
            for start in range(0, world, shard):  # reduce-scatter over the shard axis
                acc = grads[start][i].clone()
                for rank in range(start + 1, start + shard):
                    acc += grads[rank][i]
                per_replica.append(acc)
            total_grad = per_replica[0]
            for other in per_replica[1:]:  # all-reduce over the replicate axis
                total_grad = total_grad + other
            p.grad = total_grad.mul_(1.0 / world)
        opt.step()
        opt.zero_grad()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_sharded(
    rank: int,
    world: int,
    *,
    engine: str = "ours",
    steps: int = 10,
    optimizer: str = "adamw",
    mesh_shape: tuple[int, ...] | None = None,
    micro: int = 1,
    reshard_after_forward: bool | int = True,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Each rank trains on its slice of the same global batches; returns the global mean losses
    (``losses``), this rank's own (``local_losses``) and the full parameters.

    ``engine``: "ours" (fsdp_engine.fully_shard) or "fsdp2" (torch's), with identical calls.
    One intra-op thread, like ``reference_per_rank`` (see the Note at the top).
    """
    torch.set_num_threads(1)
    if engine == "ours":
        api: Any = fsdp_engine
    else:
        import torch.distributed.fsdp as api
    shape = mesh_shape or (world,)
    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _built(dtype)
    mp = api.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    api.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    opt = OPTIMIZERS[optimizer](model.parameters())
    data = batches(steps * micro, world)
    losses = []
    local_losses = []
    for step in range(steps):
        total = torch.zeros((), dtype=torch.float64)
        for m in range(micro):
            last = m == micro - 1
            model.set_requires_gradient_sync(last)
            local = data[step * micro + m].chunk(world)[rank]
            loss = loss_fn(model, local) / micro
            loss.backward()
            total += loss.detach().double()
        opt.step()
        opt.zero_grad()
        local_losses.append(total.item())
        dist.all_reduce(total)
        losses.append(total.item() / world)
    final = {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in model.state_dict().items()
    }
    return {"losses": losses, "local_losses": local_losses, "params": final}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|, computed in float64 (never rounding a float64
    difference away)."""
    worst = 0.0
    for key, want in b.items():
        scale = want.double().abs().max().clamp_min(1e-300)
        worst = max(worst, ((a[key].double() - want.double()).abs().max() / scale).item())
    return worst


def assert_bitwise_equal(got: dict[str, Any], want: dict[str, Any], what: str = "") -> None:
    """Same-arithmetic check: identical parameters (every bit) and identical losses."""
    for key, value in want["params"].items():
        other = got["params"][key]
        if not torch.equal(other, value):
            diff = (other.double() - value.double()).abs().max().item()
            raise AssertionError(f"{what}: parameter {key!r} differs (max |diff| {diff:.3e})")
    for kind in ("losses", "local_losses"):
        if kind in want and kind in got:
            assert got[kind] == want[kind], f"{what}: {kind} differ: {got[kind]} vs {want[kind]}"


STEPS = 10  # the parity tests' default run length


def per_rank_reference(world: int, steps: int = STEPS, **kwargs: Any) -> list[dict[str, Any]]:
    """``reference_per_rank`` as one result per rank, the shape ``train_sharded`` returns."""
    torch.set_num_threads(1)  # the ranks run with one thread too
    losses, params = reference_per_rank(steps, world, **kwargs)
    return [{"params": params, "local_losses": losses[rank]} for rank in range(world)]


def check_bitwise(results: list[dict[str, Any]], want: list[dict[str, Any]], what: str) -> None:
    """Same arithmetic: every rank's result equals its expected one, bitwise."""
    for rank, (got, expected) in enumerate(zip(results, want, strict=True)):
        assert_bitwise_equal(got, expected, f"{what}, rank {rank}")


def check_fp64(results: list[dict[str, Any]], ref_losses: list[float], ref: Any) -> None:
    """Different arithmetic: float64 losses and parameters within ``FP64_TOLERANCE``."""
    for result in results:
        for got, want in zip(result["losses"], ref_losses, strict=True):
            assert abs(got - want) <= FP64_TOLERANCE * max(1.0, abs(want))
        assert max_relative_difference(result["params"], ref) <= FP64_TOLERANCE


def sharded_tiny_llama(world: int, **kwargs: Any) -> tuple[TinyLlama, Any]:
    """A TinyLlama with ``initial_state``, fully_shard per layer and at the root, and its mesh."""
    mesh = init_device_mesh("cpu", (world,))
    model = build()
    model.load_state_dict(initial_state())
    for layer in model.layers:
        fsdp_engine.fully_shard(layer, mesh=mesh, **kwargs)
    fsdp_engine.fully_shard(model, mesh=mesh, **kwargs)
    return model, mesh
