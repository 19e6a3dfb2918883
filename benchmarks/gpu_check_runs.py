"""The multi-rank runs of ``gpu_check.sh``: the side-by-side benchmark and the stress race check.

Both run in one of three process-group settings, chosen by how the process was started:

- launched by ``torchrun`` (``RANK`` in the environment): a real world of ``WORLD_SIZE`` ranks,
  NCCL on CUDA (rank ``LOCAL_RANK`` on GPU ``LOCAL_RANK``), gloo on CPU;
- ``--fake-world F`` (F > 1): rank 0 of F on torch's fake process group (one GPU: every collective
  path of the engines runs, no data crosses a network; the fake all-gather copies this rank's
  shard into every chunk, its reduce-scatter keeps this rank's chunk);
- otherwise a real world of one (NCCL on CUDA, gloo on CPU).

``bench`` (one engine, one run; ``gpu_check.sh`` alternates ours and FSDP2 in separate launches):
a LLaMA-like model (``examples/llama.py``) on random tokens, AdamW, ``--warmup`` steps then
``--steps`` timed ones (each step between a barrier and a device synchronize; the slowest
rank's time), ``torch.cuda.max_memory_allocated`` / ``max_memory_reserved`` (the largest over
ranks) over every step, the first (optimizer state made) included, from what is live after
sharding (``empty_cache`` first: the blocks of the unsharded model are not counted).

``stress`` (ours only): the race check. A residual MLP at larger dimensions with a sleep kernel
of random length (up to ``--sleep-cycles``) on the communication stream right before every
collective dbuffer issues (``dbuffer._private.streams.before_collective``) and on the compute
stream around every block's forward and backward (so either side of each stream wait is
late in turn), ``torch.cuda.empty_cache()`` after every step (with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` from the script: freed memory is unmapped
and remapped, so a use after an unordered free reads someone else's data), deterministic
algorithms. Verdicts:

- in a real world of N ranks: rank 0 compares every rank's losses and the final parameters with
  a one-process reference (``reference``): the same arithmetic (each rank's micro-batch on the
  whole model, gradients summed in rank order and scaled by 1/N, the same AdamW), so at N = 2
  they are bitwise equal (a sum of two terms does not depend on the order; NCCL's and gloo's
  means of two scale by an exact 1/2); at N > 2 NCCL's ring order reassociates the sums, and the
  check is within ``tolerance``;
- on the fake process group: the losses and the shards' digest, compared by the report with a
  serial run of the same (``--serial``: no sleeps, no ``empty_cache``, ``CUDA_LAUNCH_BLOCKING=1``
  from the script) bitwise.

On CPU (the script's ``--dry``) the sleep hook is a host sleep of up to ``--host-sleep``
seconds (gloo has no streams: a CPU stand-in that only shows the hook is called once per
collective); the hook's calls per kind are in every stress run's JSON and the report fails a
run where it saw none.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import math
import os
import random
import socket
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

# Kept set by ``gpu_check.py many`` under torchrun: the runs of one launch share its process group
# (a process group re-created on the launcher's store would collide with the old one's keys).
KEEP_PROCESS_GROUP = False

# The stated tolerance where the arithmetic differs (more than two ranks: NCCL's ring sums in its
# own order). Reassociating a sum of N fp32 terms moves it by ~N * 2**-24 relative; the losses
# follow at that scale (fp32) or at bf16's resolution of the compute copy (2**-8, mixed). AdamW
# normalises updates, so a gradient element close to zero may flip its update's sign (a few
# elements move by 2 lr), while the tensor as a whole stays within a small fraction of the
# distance training moved it. A race (an unfinished all-gather read, a reduce-scatter of
# unwritten gradients, memory reused while in use) moves whole shards by whole updates or more,
# or makes them non-finite.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 2e-2}
PARAM_RTOL = {"fp32": 1e-3, "bf16": 5e-2}  # ||ours - ref|| / ||ref - initial||, per tensor


@dataclass
class Dist:
    """Where this run lives: device, rank, world, backend ("nccl", "gloo" or "fake")."""

    device: Any
    rank: int
    world: int
    backend: str
    mesh: Any
    owned: bool  # this run made the process group and destroys it


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def pick_device(name: str) -> Any:
    """``auto``: CUDA when torch sees a GPU, else CPU (under torchrun: GPU ``LOCAL_RANK``)."""
    import torch

    kind = name if name != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if kind == "cuda":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device(kind)


def setup(device_name: str, fake_world: int, timeout_s: float) -> Dist:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    device = pick_device(device_name)
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    owned = True
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if fake_world > 1:
            raise SystemExit("--fake-world is for one process, not under torchrun")
        if dist.is_initialized():
            owned = False  # an earlier run of this launch made it (``many``)
        else:
            kwargs: dict[str, Any] = {"device_id": device} if backend == "nccl" else {}
            dist.init_process_group(backend, timeout=timeout, **kwargs)
    elif fake_world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        backend = "fake"
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=fake_world)
    else:
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{_free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
        )
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    return Dist(device, dist.get_rank(), world, backend, mesh, owned)


def teardown(ctx: Dist) -> None:
    import torch.distributed as dist

    if ctx.owned and not (KEEP_PROCESS_GROUP and ctx.backend != "fake" and ctx.world > 1):
        dist.destroy_process_group()


def synchronize(ctx: Dist) -> None:
    import torch

    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


def barrier(ctx: Dist) -> None:
    import torch.distributed as dist

    if ctx.backend == "fake" or ctx.world == 1:
        return
    if ctx.backend == "nccl":
        dist.barrier(device_ids=[ctx.device.index])
    else:
        dist.barrier()
    synchronize(ctx)


def max_over_ranks(ctx: Dist, values: list[float]) -> list[float]:
    """Elementwise maximum over the ranks (this rank's values on the fake process group)."""
    import torch
    import torch.distributed as dist

    if ctx.backend == "fake" or ctx.world == 1 or not values:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(v) for v in t.cpu()]


def _api(engine: str) -> Any:
    if engine == "ours":
        import fsdp_engine

        return fsdp_engine
    import torch.distributed.fsdp as fsdp2

    return fsdp2


def _mp(api: Any, mixed: bool) -> Any:
    import torch

    if mixed:
        return api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return api.MixedPrecisionPolicy()


# -- bench --------------------------------------------------------------------------------------


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from llama import Llama, ModelConfig, loss_fn

    ctx = setup(args.device, args.fake_world, args.pg_timeout)
    try:
        cfg = ModelConfig(
            vocab=args.vocab,
            dim=args.dim,
            layers=args.layers,
            heads=args.heads,
            ffn=args.ffn,
            seq=args.seq,
        )
        torch.manual_seed(0)
        with torch.device(ctx.device):
            model = Llama(cfg)
        params = sum(p.numel() for p in model.parameters())
        api = _api(args.engine)
        mp = _mp(api, args.mixed)
        mesh = _stress_mesh(ctx, args.hsdp)  # FSDP, or HSDP: 2 replicas x world / 2 shards
        for layer in model.layers:
            api.fully_shard(layer, mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)  # CUDA's default
        gen = torch.Generator().manual_seed(1 + ctx.rank)
        batches = [
            torch.randint(0, cfg.vocab, (args.batch, cfg.seq + 1), generator=gen).to(ctx.device)
            for _ in range(4)
        ]
        cuda = ctx.device.type == "cuda"
        synchronize(ctx)
        if cuda:  # from what is live after sharding: the unsharded model's cached blocks go back
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)
        times: list[float] = []
        losses = []
        for step in range(args.warmup + args.steps):
            barrier(ctx)
            start = time.perf_counter()
            loss = loss_fn(model, batches[step % len(batches)])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(ctx)
            if step >= args.warmup:
                times.append(time.perf_counter() - start)
            losses.append(loss.detach())
        times = max_over_ranks(ctx, times)  # each step: the slowest rank's time
        out: dict[str, Any] = {
            "kind": "bench",
            "engine": args.engine,
            "config": args.config,
            "mesh": list(mesh.shape),
            "index": args.index,
            "backend": ctx.backend,
            "world": ctx.world,
            "device": str(ctx.device.type),
            "mixed": args.mixed,
            "avoid_record_streams": os.environ.get("TORCH_NCCL_AVOID_RECORD_STREAMS", ""),
            "model": {**cfg.as_dict(), "batch_per_rank": args.batch, "parameters": params},
            "warmup": args.warmup,
            "steps_ms": [1e3 * t for t in times],
            "median_ms": 1e3 * statistics.median(times),
            "min_ms": 1e3 * min(times),
            "losses": [float(v) for v in torch.stack(losses).float().cpu()],
            "memory": None,
        }
        if cuda:
            stats = torch.cuda.memory_stats(ctx.device)
            peaks = max_over_ranks(
                ctx,
                [
                    float(torch.cuda.max_memory_allocated(ctx.device)),
                    float(torch.cuda.max_memory_reserved(ctx.device)),
                    float(stats.get("num_alloc_retries", 0)),
                    float(stats.get("num_device_alloc", 0)),
                    float(torch.cuda.memory_allocated(ctx.device)),
                ],
            )
            out["memory"] = dict(
                zip(
                    (
                        "max_allocated",
                        "max_reserved",
                        "alloc_retries",
                        "device_allocs",
                        "allocated_between_steps",
                    ),
                    (int(v) for v in peaks),
                    strict=True,
                )
            )
        return out
    finally:
        teardown(ctx)


# -- stress -------------------------------------------------------------------------------------


class SleepHook:
    """dbuffer's ``before_collective``: a sleep kernel of random length (0 to ``cycles``, from a
    seeded generator) on the collective's stream, the current one when called; without streams
    (CPU) a host sleep of up to ``host_s`` seconds, the stand-in. Counts its calls per kind."""

    def __init__(self, cycles: int, host_s: float, seed: int) -> None:
        self.cycles, self.host_s = cycles, host_s
        self.rng = random.Random(seed)
        self.calls: Counter[str] = Counter()
        self.without_stream = 0
        self.not_current = 0

    def __call__(self, kind: str, stream: Any) -> None:
        import torch

        self.calls[kind] += 1
        if stream is None:
            self.without_stream += 1
            if self.host_s > 0:
                time.sleep(self.rng.uniform(0.0, self.host_s))
            return
        if torch.accelerator.current_stream(stream.device) != stream:
            self.not_current += 1  # the hook's contract: the collective's stream is current
        if self.cycles > 0 and stream.device.type == "cuda":
            torch.cuda._sleep(self.rng.randrange(self.cycles))

    def compute(self) -> None:
        """A sleep on the current (compute) stream: the other side of each wait late."""
        import torch

        if self.cycles > 0 and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda._sleep(self.rng.randrange(self.cycles))

    def summary(self) -> dict[str, Any]:
        return {
            "calls": dict(self.calls),
            "without_stream": self.without_stream,
            "not_current": self.not_current,
            "cycles": self.cycles,
            "host_s": self.host_s,
        }


@contextlib.contextmanager
def installed(hook: SleepHook | None, model: Any, device: Any) -> Iterator[None]:
    """``hook`` as dbuffer's ``before_collective`` and around every block (compute sleeps on
    CUDA) for the body; everything removed after."""
    from dbuffer._private import streams

    if hook is None:
        yield
        return
    handles = []
    if device.type == "cuda":

        def before(_module: Any, _inputs: Any) -> None:
            hook.compute()

        def after(_module: Any, _inputs: Any, output: Any) -> None:
            hook.compute()
            if output.requires_grad:  # runs in backward, on the stream backward runs on
                output.register_hook(backward)

        def backward(grad: Any) -> Any:
            hook.compute()
            return grad

        for block in model.blocks:
            handles.append(block.register_forward_pre_hook(before))
            handles.append(block.register_forward_hook(after))
    previous, streams.before_collective = streams.before_collective, hook
    try:
        yield
    finally:
        streams.before_collective = previous
        for handle in handles:
            handle.remove()


def stress_data(args: argparse.Namespace, world: int, device: Any) -> list[tuple[Any, Any]]:
    """4 global batches of ``world * batch`` rows (rank r takes chunk r), on ``device``."""
    import torch

    gen = torch.Generator().manual_seed(1)
    rows = world * args.batch
    return [
        (
            torch.randn(rows, args.dim, generator=gen).to(device),
            torch.randn(rows, 1, generator=gen).to(device),
        )
        for _ in range(4)
    ]


def _initial_model(args: argparse.Namespace, device: Any) -> Any:
    """The same initial weights in every process (made on CPU from seed 0, then moved)."""
    import torch
    from bench_scale_host import build_model

    torch.manual_seed(0)
    return build_model(args.layers, args.dim, args.hidden).to(device)


def _stress_mesh(ctx: Dist, hsdp: bool) -> Any:
    """FSDP: the 1-D mesh of every rank; HSDP: 2 replicas x ``world / 2`` shards (the
    replicas' all-reduce on the all-reduce stream; at 2 ranks each shard group is one rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    if not hsdp:
        return ctx.mesh
    if ctx.world % 2:
        raise SystemExit(f"--hsdp needs an even world size, not {ctx.world}")
    return init_device_mesh(
        ctx.device.type, (2, ctx.world // 2), mesh_dim_names=("replicate", "shard")
    )


def _user_all_gather(**kwargs: Any) -> Any:
    """A user all-gather (FSDP2's custom-collective interface) wrapping the backend's."""
    import torch.distributed as dist

    return dist.all_gather_single(
        kwargs["output_tensor"],
        kwargs["input_tensor"],
        group=kwargs["group"],
        async_op=kwargs["async_op"],
    )


def _user_reduce_scatter(**kwargs: Any) -> Any:
    import torch.distributed as dist

    return dist.reduce_scatter_single(
        kwargs["output_tensor"],
        kwargs["input_tensor"],
        op=kwargs["op"],
        group=kwargs["group"],
        async_op=kwargs["async_op"],
    )


def stress(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.distributed.tensor import DTensor

    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)  # CPU kernels' reductions depend on the thread count
    ctx = setup(args.device, args.fake_world, args.pg_timeout)
    try:
        model = _initial_model(args, ctx.device)
        import fsdp_engine as api

        mp = _mp(api, args.mixed)
        if args.float8:  # FP8 codes of 1 x 8 tiles in the all-gather, its stream's temporaries
            quantized = api.QuantizedAllGather(format="float8_e4m3fn", block=(1, 8), min_numel=1)
            mp = api.MixedPrecisionPolicy(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float32,
                quantized_all_gather=quantized,
            )
        mesh = _stress_mesh(ctx, args.hsdp)
        for block in model.blocks:
            api.fully_shard(block, mesh=mesh, mp_policy=mp)
        api.fully_shard(model, mesh=mesh, mp_policy=mp)
        if args.custom_collectives:  # a user's collectives: they too run on the comm streams
            for module in (*model.blocks, model):
                module.set_custom_all_gather(_user_all_gather)
                module.set_custom_reduce_scatter(_user_reduce_scatter)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
        # a real world: rank r's rows of the global batch; fake: rank 0's rows of a world of one
        real = ctx.backend != "fake"
        data = stress_data(args, ctx.world if real else 1, ctx.device)
        hook = None if args.serial else SleepHook(args.sleep_cycles, args.host_sleep, ctx.rank)
        cuda = ctx.device.type == "cuda"
        losses = []
        with installed(hook, model, ctx.device):
            for step in range(args.steps):
                x, y = (
                    t.chunk(ctx.world if real else 1)[ctx.rank if real else 0]
                    for t in data[step % 4]
                )
                loss = (model(x).float() - y).pow(2).mean()
                loss.backward()
                opt.step()
                # in-place gradients: the next reduction accumulates into the kept .grad
                opt.zero_grad(set_to_none=not args.inplace_grads)
                losses.append(loss.detach())
                if cuda and not args.serial:
                    torch.cuda.empty_cache()  # unmap what was freed: a late use reads new data
        local = torch.stack(losses)
        out: dict[str, Any] = {
            "kind": "stress",
            "case": "bf16" if args.mixed else "fp32",
            "backend": ctx.backend,
            "world": ctx.world,
            "device": str(ctx.device.type),
            "serial": args.serial,
            "steps": args.steps,
            "model": {"layers": args.layers, "dim": args.dim, "hidden": args.hidden},
            "batch_per_rank": args.batch,
            "launch_blocking": os.environ.get("CUDA_LAUNCH_BLOCKING", ""),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "hook": None if hook is None else hook.summary(),
            "variant": {
                "mesh": list(mesh.shape),
                "hsdp": args.hsdp,
                "custom_collectives": args.custom_collectives,
                "inplace_grads": args.inplace_grads,
                "float8": args.float8,
            },
        }
        if not real:
            digest = hashlib.sha256()
            for name, param in sorted(model.named_parameters()):
                shard = param.to_local() if isinstance(param, DTensor) else param
                digest.update(name.encode())
                digest.update(shard.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            out["losses"] = [float(v).hex() for v in local.cpu()]
            out["params_sha256"] = digest.hexdigest()
            return out
        every = _all_losses(ctx, local)  # (world, steps)
        full = {
            name: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for name, p in model.named_parameters()
        }
        if ctx.rank == 0:
            out["compare"] = compare(args, ctx, every, full)
        barrier(ctx)
        return out
    finally:
        teardown(ctx)


def _all_losses(ctx: Dist, local: Any) -> Any:
    import torch
    import torch.distributed as dist

    gathered = torch.empty(ctx.world * local.numel(), dtype=local.dtype, device=local.device)
    dist.all_gather_single(gathered, local.contiguous())  # aliased on older torch (torch_shims)
    return gathered.view(ctx.world, -1)


def _fp8_roundtrip(master: Any) -> Any:
    """What the FP8 quantized all-gather (``--float8``: 1 x 8 tiles) gives for ``master``:
    the whole weight quantized and dequantized into bf16 (bitwise the sharded result, [Note: a
    shard quantizes exactly its own tiles])."""
    import torch

    from fsdp_engine._private.quantize import dequantize_panel, panel_shape, quantize_panel

    block = (1, 8)
    panel = master.detach().reshape(panel_shape(tuple(master.shape), block))
    codes, scales = quantize_panel(panel, block, "float8_e4m3fn")
    out = dequantize_panel(codes, scales, block, dtype=torch.bfloat16)
    return out.view(master.shape)


def reference(args: argparse.Namespace, world: int, device: Any) -> tuple[Any, Any, Any]:
    """One process, the sharded run's arithmetic: per step, each rank's rows on the whole model
    (a bf16 copy of the fp32 parameters with ``--mixed``, its gradients cast to fp32), the
    gradients summed in rank order and scaled by ``1 / world``, then the same AdamW on the
    whole fp32 parameters (elementwise: the same per element as on shards). Returns the losses
    (world, steps), the final and the initial parameters."""
    import torch

    torch.use_deterministic_algorithms(True)
    model = _initial_model(args, device)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    work = copy.deepcopy(model).to(torch.bfloat16) if args.mixed else model
    pairs = list(zip(model.parameters(), work.parameters(), strict=True))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    data = stress_data(args, world, device)
    losses = torch.empty(world, args.steps, device=device)
    for step in range(args.steps):
        xs, ys = (t.chunk(world) for t in data[step % 4])
        if args.mixed:
            with torch.no_grad():
                for master, low in pairs:
                    # the gathered FP8 codes, dequantized: the policy's default choice, the
                    # weights of >= 2 dims (biases travel in bf16)
                    if getattr(args, "float8", False) and master.dim() >= 2:
                        low.copy_(_fp8_roundtrip(master))
                    else:
                        low.copy_(master)  # the engine's cast of the shard, elementwise
        total: list[Any] = []
        for rank in range(world):
            work.zero_grad(set_to_none=True)
            x = xs[rank].to(torch.bfloat16) if args.mixed else xs[rank]
            loss = (work(x).float() - ys[rank]).pow(2).mean()
            loss.backward()
            losses[rank, step] = loss.detach()
            grads = [low.grad.float() if args.mixed else low.grad.clone() for _, low in pairs]
            total = grads if rank == 0 else [t.add_(g) for t, g in zip(total, grads, strict=True)]
        for (master, _), grad in zip(pairs, total, strict=True):
            master.grad = grad.mul_(1.0 / world)
        opt.step()
        opt.zero_grad(set_to_none=True)
    final = {name: p.detach() for name, p in model.named_parameters()}
    return losses, final, initial


def compare(
    args: argparse.Namespace, ctx: Dist, losses: Any, params: dict[str, Any]
) -> dict[str, Any]:
    """Ours (every rank's losses, the full final parameters) against ``reference`` (``judge``);
    a mismatch is printed loudly too."""
    case = "bf16" if args.mixed else "fp32"
    ref_losses, ref_params, initial = reference(args, ctx.world, ctx.device)
    result = judge(losses, params, ref_losses, ref_params, initial, case=case, world=ctx.world)
    if result["verdict"] == "MISMATCH":
        print(f"STRESS MISMATCH ({case}, {ctx.world} ranks): {result}", file=sys.stderr)
    return result


def judge(
    losses: Any,
    params: dict[str, Any],
    ref_losses: Any,
    ref_params: dict[str, Any],
    initial: dict[str, Any],
    *,
    case: str,
    world: int,
) -> dict[str, Any]:
    """``bitwise`` (every loss and parameter equal), ``within tolerance`` (``LOSS_RTOL``: every
    loss relative to the reference's; ``PARAM_RTOL``: per tensor, the distance to the
    reference relative to the distance training moved it), else ``MISMATCH``; non-finite
    values are a mismatch."""
    import torch

    finite = bool(torch.isfinite(losses).all()) and all(
        bool(torch.isfinite(p).all()) for p in params.values()
    )
    loss_equal = losses.shape == ref_losses.shape and torch.equal(losses, ref_losses)
    loss_rel = math.inf
    if losses.shape == ref_losses.shape:
        loss_rel = float(((losses - ref_losses).abs() / ref_losses.abs().clamp_min(1e-12)).max())
    worst: tuple[float, str] = (0.0, "")
    param_equal = set(params) == set(ref_params)
    for name, ref in ref_params.items():
        ours = params.get(name)
        if ours is None or ours.shape != ref.shape:
            worst = max(worst, (math.inf, name))
            continue
        ours = ours.to(ref.dtype)
        if torch.equal(ours, ref):
            continue
        param_equal = False
        moved = float((ref - initial[name]).norm())
        rel = float((ours - ref).norm()) / max(moved, 1e-30)
        worst = max(worst, (rel if math.isfinite(rel) else math.inf, name))
    bitwise = finite and loss_equal and param_equal
    within = finite and loss_rel <= LOSS_RTOL[case] and worst[0] <= PARAM_RTOL[case]
    first = None
    if not loss_equal and losses.shape == ref_losses.shape:
        differs = (losses != ref_losses).any(dim=0).nonzero()
        first = int(differs[0]) if differs.numel() else None
    return {
        "verdict": "bitwise" if bitwise else ("within tolerance" if within else "MISMATCH"),
        "expected": "bitwise" if world <= 2 else "within tolerance",
        "finite": finite,
        "losses_equal": loss_equal,
        "loss_max_rel_diff": loss_rel,
        "first_differing_step": first,
        "params_equal": param_equal,
        "param_worst_rel_diff": worst[0],
        "param_worst": worst[1],
        "tolerance": {"loss_rtol": LOSS_RTOL[case], "param_rtol": PARAM_RTOL[case]},
        "last_loss_rank0": float(ref_losses[0, -1]),
    }
