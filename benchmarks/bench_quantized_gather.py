"""Quantized weight communication, side by side in one run: ours with the bf16 all-gather vs ours
with blockwise FP8 / int8 all-gathers (``QuantizedAllGather``), torch FSDP2 with the bf16
all-gather, and FSDP2 with torchao's tensor-wise float8 all-gather (when torchao imports).

Two parts, each engines **alternating step by step** in the same processes on the same model
(same initial weights), batches and optimizer (AdamW), mixed precision bf16 compute / fp32
reduction:

- ``--part speed`` (default): the demo's medium model (``examples/llama.py``) at world sizes 2
  and 4, with one and with two transformer layers per ``fully_shard`` call (every engine
  grouped alike; ``--layers-per-group``): step time (median and min of the timed steps; the
  paired ratio to ours-bf16 is the median of per-step ratios), collectives of one measured
  step counted at the dispatcher (``c10d`` ops; bytes = what this rank puts in): the
  all-gathers carry the weights, so their bytes against ours-bf16's are the
  weight-communication ratio; peak live memory per rank (``dbuffer.testing.LiveBytes``); the loss
  after the last step.
- ``--part convergence``: the demo corpus, 600 steps, two seeds, world size 2, the demo's small
  model (dim 128, so 128x128 tiles fit its matrices): validation loss (32 fixed batches) every
  100 steps and at the end; the final ratio to ours-bf16.

torchao's float8 (``convert_to_float8_training`` with ``enable_fsdp_float8_all_gather``) also
runs its GEMMs in float8 (inputs and gradients cast too; emulated on CPU, which has no float8
GEMM kernel), so its step time is not that of the communication alone; gloo has no float8
collectives, so its all-gather is given FSDP2's ``set_custom_all_gather`` hook viewing the
bytes as uint8 (the same bytes move).

Writes into ``--out`` (default ``results/``): ``bench_quantized_gather.{md,json}`` (speed) and
``quantized_convergence.{md,json,png}`` (convergence).

    python benchmarks/bench_quantized_gather.py [--part speed|convergence|all] [--worlds 2 4]
        [--layers-per-group 1 2]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao eager (its compiled path is slow here)

import torch
import torch.distributed as dist
from bench_engine import _model_roots, _paired, _tensors_in, machine
from llama import PRESETS, ModelConfig, get_batch, load_corpus, loss_fn
from llama import Llama as LlamaModel
from run_tools import CollectiveTally
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ROOT = Path(__file__).resolve().parent.parent
BETAS = (0.9, 0.95)
LR = 3e-3
WD = 0.1
OURS = {
    "ours-bf16": None,
    "ours-fp8": ("float8_e4m3fn", (128, 128)),
    "ours-int8": ("int8", (128, 128)),
    "ours-fp8-rows": ("float8_e4m3fn", (1, 128)),
}
LABELS = {
    "ours-bf16": "ours, bf16 all-gather",
    "ours-fp8": "ours, FP8 e4m3 128x128 tiles",
    "ours-int8": "ours, int8 128x128 tiles",
    "ours-fp8-rows": "ours, FP8 e4m3 1x128 rows",
    "fsdp2-bf16": "FSDP2, bf16 all-gather",
    "fsdp2-torchao-fp8": "FSDP2 + torchao float8 (tensor-wise)",
}
SPEED_ENGINES = tuple(LABELS)
CONVERGENCE_ENGINES = ("ours-bf16", "ours-fp8", "ours-int8")


def torchao_missing() -> str | None:
    """Why torchao's float8 row cannot run here (None: it can)."""
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # ImportError, or a broken install's own error
        return f"`import torchao.float8` fails: {type(error).__name__}: {error}"
    return None


@dataclass
class Runner:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    after_step: Callable[[], None] = lambda: None
    times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)

    def step(self, tokens: torch.Tensor) -> float:
        loss = loss_fn(self.model, tokens)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad()
        self.after_step()
        return float(loss.detach())


class BytesAllGather:
    """FSDP2's all-gather, moving float8 inputs as their bytes (gloo has no float8 dtype)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: Any,
        async_op: bool = False,
    ) -> Any:
        if input_tensor.element_size() == 1 and input_tensor.dtype != torch.uint8:
            output_tensor, input_tensor = (
                output_tensor.view(torch.uint8),
                input_tensor.view(torch.uint8),
            )
        return dist.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


def layer_groups(model: nn.Module, per_group: int) -> list[list[nn.Module]]:
    """The transformer layers in consecutive groups of ``per_group``: one ``fully_shard`` each."""
    layers = list(model.layers)  # type: ignore[arg-type]
    return [layers[i : i + per_group] for i in range(0, len(layers), per_group)]


def build(engine: str, cfg: ModelConfig, mesh: DeviceMesh, seed: int, per_group: int = 1) -> Runner:
    torch.manual_seed(seed)  # the same initial weights for every engine and rank
    model = LlamaModel(cfg)
    after: Callable[[], None] = lambda: None  # noqa: E731
    if engine.startswith("ours"):
        import fsdp_engine

        quant = OURS[engine]
        policy = None if quant is None else fsdp_engine.QuantizedAllGather(*quant)  # type: ignore[arg-type]
        mp = fsdp_engine.MixedPrecisionPolicy(
            torch.bfloat16, torch.float32, quantized_all_gather=policy
        )
        for group in layer_groups(model, per_group):
            fsdp_engine.fully_shard(group, mesh=mesh, mp_policy=mp)
        fsdp_engine.fully_shard(model, mesh=mesh, mp_policy=mp)
    else:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

        if engine == "fsdp2-torchao-fp8":
            from torchao.float8 import (
                Float8LinearConfig,
                convert_to_float8_training,
                precompute_float8_dynamic_scale_for_fsdp,
            )

            # No fast float8 GEMM on CPU (torchao's: ~60 s for one forward and backward of two
            # 256x768 layers on 1024 tokens here, 0.07 s emulated): its emulation (dequantize,
            # then the matmul) there.
            # The all-gather, what this table compares, is the same float8 one either way.
            emulate = mesh.device_type == "cpu"
            convert_to_float8_training(
                model,
                config=Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate),
                module_filter_fn=lambda module, fqn: fqn != "head",  # vocab rows: not /16
            )

            def after() -> None:
                precompute_float8_dynamic_scale_for_fsdp(model)

        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for group in layer_groups(model, per_group):
            fully_shard(group, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        if engine == "fsdp2-torchao-fp8":
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    module.set_custom_all_gather(BytesAllGather())  # type: ignore[arg-type]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=WD)
    return Runner(engine, model, opt, after)


def _timed(runner: Runner, tokens: torch.Tensor) -> tuple[float, float]:
    dist.barrier()
    start = time.perf_counter()
    loss = runner.step(tokens)
    dist.barrier()
    return time.perf_counter() - start, loss


# -- speed and bytes ----------------------------------------------------------------------------


def speed_worker(
    rank: int, world: int, engines: list[str], steps: int, warmup: int, per_group: int = 1
) -> Any:
    from dbuffer.testing import LiveBytes

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    cfg = PRESETS["medium"].with_vocab(corpus.vocab)
    runners = [build(e, cfg, mesh, seed=0, per_group=per_group) for e in engines]
    gen = torch.Generator().manual_seed(1000 + rank)
    batch = 4
    batches = [get_batch(corpus.train, gen, batch, cfg.seq) for _ in range(warmup + steps)]
    measured: dict[str, Any] = {}
    for i, tokens in enumerate(batches):
        order = runners if i % 2 == 0 else runners[::-1]  # alternate who goes first
        for r in order:
            if i == warmup - 1:  # optimizer state exists: the measured step
                tally = CollectiveTally()
                seed = _model_roots(r.model) + list(_tensors_in(r.opt))
                with LiveBytes(seed=seed) as live, tally:
                    loss = r.step(tokens)
                r.losses.append(loss)
                measured[r.name] = {
                    "peak_live_bytes": live.peak,
                    "collectives": dict(tally.calls),
                    "collective_bytes": dict(tally.bytes),
                }
                continue
            elapsed, loss = _timed(r, tokens)
            r.losses.append(loss)
            if i >= warmup:
                r.times.append(elapsed)
    out = {r.name: {"times": r.times, "losses": r.losses, **measured[r.name]} for r in runners}
    del runners
    gc.collect()
    return {"model": cfg.as_dict(), "batch": batch, "per_group": per_group, "engines": out}


def _gather_bytes(e: dict[str, Any]) -> int:
    return sum(v for k, v in e["collective_bytes"].items() if "allgather" in k or "all_gather" in k)


def speed_rows(results: dict[tuple[int, int], dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (world, per_group), res in sorted(results.items()):
        engines = res["engines"]
        base = engines["ours-bf16"]
        for name, e in engines.items():
            other = {
                k: v
                for k, v in e["collective_bytes"].items()
                if "allgather" not in k and "all_gather" not in k
            }
            rows.append(
                {
                    "world": world,
                    "layers_per_group": per_group,
                    "engine": name,
                    "label": LABELS[name],
                    "median_s": statistics.median(e["times"]),
                    "min_s": min(e["times"]),
                    "paired_vs_ours_bf16": _paired(e["times"], base["times"]),
                    "gather_bytes": _gather_bytes(e),
                    "gather_ratio": _gather_bytes(e) / _gather_bytes(base),
                    "gathers": sum(v for k, v in e["collectives"].items() if "allgather" in k),
                    "other_bytes": other,
                    "peak_live_bytes": max(e["peak_live_bytes_per_rank"]),
                    "final_loss": e["losses"][-1],
                }
            )
    return rows


def speed_markdown(
    rows: list[dict[str, Any]], info: dict[str, str], steps: int, torchao: str | None
) -> str:
    lines = [
        f"{info['date']}; {info['cpu']}, {info['nproc']} cores; torch {info['torch']}, gloo; "
        f"load average at the end {info['load']}; commit {info['commit']}. "
        "`python benchmarks/bench_quantized_gather.py --part speed`. The demo's medium model "
        "(dim 256, 4 layers, FFN 768, seq 256, batch 4 per rank), AdamW, bf16 compute / fp32 "
        f"reduction, engines alternating step by step, {steps} timed steps after warm-up. "
        "Weight bytes: the all-gathers of one step counted at the dispatcher (what this rank "
        "puts in; codes, scales and the bf16 norms for ours). Step ratio: median of the paired "
        "per-step ratios to ours-bf16 (< 1: faster), within the same world size and grouping. "
        "Layers per group: transformer layers per `fully_shard` call (the same for every engine "
        "of a block of rows). FSDP2 + torchao: `Float8LinearConfig(enable_fsdp_float8_all_gather"
        "=True)`, tensor-wise scales, its GEMMs emulated on CPU (`emulate=True`: no float8 GEMM "
        "kernel here), the output head left in bf16 (103 rows)."
        + ("" if torchao is None else f" No torchao row: {torchao}."),
        "",
        "| world | layers per group | engine | step median s (min) | step / ours-bf16 | "
        "all-gathers per step | "
        "weight MiB per step | weight bytes / ours-bf16 | other collectives MiB | "
        "peak live MiB | loss after the last step |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        other = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(r["other_bytes"].items()))
        lines.append(
            f"| {r['world']} | {r['layers_per_group']} | {r['label']} | "
            f"{r['median_s']:.3f} ({r['min_s']:.3f}) | "
            f"{r['paired_vs_ours_bf16']:.2f}x | {r['gathers']} | {r['gather_bytes'] / 2**20:.2f} | "
            f"{r['gather_ratio']:.3f}x | {other} | {r['peak_live_bytes'] / 2**20:.1f} | "
            f"{r['final_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


# -- convergence ------------------------------------------------------------------------------


def convergence_worker(
    rank: int, world: int, engines: list[str], steps: int, seed: int, every: int
) -> Any:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    cfg = PRESETS["small"].with_vocab(corpus.vocab)
    runners = [build(e, cfg, mesh, seed=seed) for e in engines]
    gen = torch.Generator().manual_seed(1000 * (seed + 1) + rank)  # each rank its own data
    val_gen = torch.Generator().manual_seed(7)
    batch = 16
    val = [get_batch(corpus.val, val_gen, batch, cfg.seq) for _ in range(32)]
    curves: dict[str, list[tuple[int, float]]] = {e: [] for e in engines}
    start = time.perf_counter()
    for step in range(steps):
        tokens = get_batch(corpus.train, gen, batch, cfg.seq)
        order = runners if step % 2 == 0 else runners[::-1]
        for r in order:
            r.losses.append(r.step(tokens))
        if (step + 1) % every == 0 or step == steps - 1:
            for r in runners:
                curves[r.name].append((step + 1, _validate(r.model, val, world)))
            if rank == 0:
                done = ", ".join(f"{n} {c[-1][1]:.4f}" for n, c in curves.items())
                wall = time.perf_counter() - start
                print(f"seed {seed} step {step + 1}: val {done} ({wall:.0f} s)", flush=True)
    return {
        "model": cfg.as_dict(),
        "batch": batch,
        "seed": seed,
        "val": curves,
        "train": {r.name: r.losses for r in runners},
        "wall_s": time.perf_counter() - start,
    }


@torch.no_grad()
def _validate(model: nn.Module, batches: list[torch.Tensor], world: int) -> float:
    total = torch.zeros(())
    for tokens in batches:
        total += loss_fn(model, tokens)
    dist.all_reduce(total)
    return total.item() / (len(batches) * world)


def convergence_markdown(runs: list[dict[str, Any]], info: dict[str, str]) -> str:
    engines = list(runs[0]["val"])
    steps = runs[0]["val"][engines[0]][-1][0]
    lines = [
        f"{info['date']}; {info['cpu']}, {info['nproc']} cores; torch {info['torch']}, gloo, "
        f"world size 2; load average at the end {info['load']}; commit {info['commit']}. "
        "`python benchmarks/bench_quantized_gather.py --part convergence` (run under `nice`). "
        f"The demo corpus, the demo's small model (dim 128, 4 layers), {steps} steps, batch 16 "
        "per rank, AdamW lr 3e-3, bf16 compute / fp32 reduction; engines alternate step by step "
        "on the same batches from the same initial weights; validation loss over 32 fixed "
        "batches.",
        "",
        "| seed | "
        + " | ".join(LABELS[e] for e in engines)
        + " | "
        + " | ".join(f"{LABELS[e]} / bf16" for e in engines[1:])
        + " |",
        "|---" * (2 * len(engines)) + "|",
    ]
    finals: dict[str, list[float]] = {e: [] for e in engines}
    for run in runs:
        values = {e: run["val"][e][-1][1] for e in engines}
        for e in engines:
            finals[e].append(values[e])
        base = values[engines[0]]
        lines.append(
            f"| {run['seed']} | "
            + " | ".join(f"{values[e]:.4f}" for e in engines)
            + " | "
            + " | ".join(f"{values[e] / base:.4f}" for e in engines[1:])
            + " |"
        )
    mean = {e: statistics.mean(v) for e, v in finals.items()}
    lines.append(
        "| mean | "
        + " | ".join(f"{mean[e]:.4f}" for e in engines)
        + " | "
        + " | ".join(f"{mean[e] / mean[engines[0]]:.4f}" for e in engines[1:])
        + " |"
    )
    return "\n".join(lines) + "\n"


def convergence_chart(runs: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no chart")
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    styles = ["-", "--", ":"]
    for run, style in zip(runs, styles, strict=False):
        for name, curve in run["val"].items():
            xs, ys = zip(*curve, strict=True)
            ax.plot(xs, ys, style, label=f"{LABELS[name]}, seed {run['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss (nats per character)")
    ax.set_title("Quantized all-gather: convergence on the demo corpus (world size 2)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> None:
    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--part", choices=("speed", "convergence", "all"), default="speed")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument(
        "--layers-per-group",
        type=int,
        nargs="+",
        default=[1, 2],
        help="transformer layers per fully_shard call (speed; each value its own run)",
    )
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine (speed)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps (the last is measured)")
    p.add_argument("--train-steps", type=int, default=600, help="convergence steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--timeout", type=float, default=7200.0)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torchao = torchao_missing()
    if torchao is not None:
        print(f"no torchao row: {torchao} (pip install torchao)")
    if args.part in ("speed", "all"):
        engines = [e for e in SPEED_ENGINES if e != "fsdp2-torchao-fp8" or torchao is None]
        results: dict[tuple[int, int], dict[str, Any]] = {}
        for world in args.worlds:
            for per_group in args.layers_per_group:
                start = time.perf_counter()
                per_rank = run_processes(
                    speed_worker,
                    world,
                    engines,
                    args.steps,
                    args.warmup,
                    per_group,
                    timeout=args.timeout,
                )
                results[(world, per_group)] = per_rank[0]
                for name, e in per_rank[0]["engines"].items():
                    e["peak_live_bytes_per_rank"] = [
                        r["engines"][name]["peak_live_bytes"] for r in per_rank
                    ]
                wall = time.perf_counter() - start
                print(f"world {world}, {per_group} layers per group: {wall:.0f} s", flush=True)
        rows = speed_rows(results)
        info = machine()
        table = speed_markdown(rows, info, args.steps, torchao)
        (out / "bench_quantized_gather.md").write_text(table)
        raw = {f"world {w}, {g} layers per group": v for (w, g), v in results.items()}
        payload = {"machine": info, "args": vars(args), "rows": rows, "raw": raw}
        (out / "bench_quantized_gather.json").write_text(json.dumps(payload, indent=1))
        print(table)
    if args.part in ("convergence", "all"):
        runs = []
        for seed in args.seeds:
            per_rank = run_processes(
                convergence_worker,
                2,
                list(CONVERGENCE_ENGINES),
                args.train_steps,
                seed,
                args.eval_every,
                timeout=args.timeout,
            )
            runs.append(per_rank[0])
        info = machine()
        table = convergence_markdown(runs, info)
        (out / "quantized_convergence.md").write_text(table)
        (out / "quantized_convergence.json").write_text(
            json.dumps({"machine": info, "args": vars(args), "runs": runs}, indent=1)
        )
        convergence_chart(runs, out / "quantized_convergence.png")
        print(table)


if __name__ == "__main__":
    main()
