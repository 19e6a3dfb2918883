"""Side by side: our engine + our optimizers vs torch FSDP2 + the optimizers users run today.

One run per world size (2 and 4, real gloo processes on this CPU). In each process both sides
shard their own copy of the same LLaMA-like model (``examples/llama.py``, same initial weights),
take the same batches and **alternate step by step** (who goes first alternates too), so machine
load hits both alike.

Cases:
- **Muon**: ours = ``fsdp_engine.fully_shard`` (per layer + root, ``Muon.block_policy()``) +
  ``optim_blockwise.Muon`` (hidden matrices with Muon, the rest with its AdamW path); peer =
  ``torch.distributed.fsdp.fully_shard`` + ``torch.optim.Muon`` on the same hidden matrices +
  ``torch.optim.AdamW`` on the rest. Identical hyper-parameters: lr, momentum 0.95, Nesterov,
  5 Newton-Schulz steps in bf16 (``torch.optim.Muon`` casts to bf16, so ours runs
  ``ns_dtype=torch.bfloat16``), ``adjust_lr_fn="original"``, decoupled weight decay, AdamW betas
  and eps.
- **AdamW8bit**: ours = our ``fully_shard`` with ``AdamW8bit.block_policy(block_size=256)`` +
  ``optim_blockwise.AdamW8bit(block_size=256)``; peer = FSDP2 + ``torchao.optim.AdamW8bit``
  (block 256, eager: ``TORCHDYNAMO_DISABLE=1``).

Per case, world size and side: step time (forward, backward, optimizer step, zero_grad; barrier
before and after, rank 0's clock; median and min of the timed steps, and the paired ratio = median
of ours_i / peer_i), the optimizer step alone, collectives per step (``ragged_dtensor.testing.
count_collectives`` around every step: ``torch.distributed.*`` calls; plus, on one untimed step,
every ``c10d`` / ``_c10d_functional`` op at the dispatcher, which also sees DTensor's functional
collectives), optimizer state bytes per rank (local tensors of ``optimizer.state``; torchao's
8-bit subclasses counted by their inner tensors) and the max |difference| of the final full
parameters against the same optimizer class trained on one process with the global batch (every
rank's batch concatenated) for the same number of steps.

The model (dim 64, ffn 96) has matrices of 6144 elements: 8-bit state on one device (>= 4096)
but local shards of 3072 / 1536 elements at world sizes 2 / 4, where torchao decides per local
shard and keeps fp32 state (pytorch/ao#4912); ours decides on the global shape.

    python benchmarks/bench_optim_engine.py [--out results] [--worlds 2 4] [--steps 16]
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao eager on CPU (before torch import)

import argparse
import contextlib
import json
import math
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch
import torch.distributed as dist
from bench_engine import Optimizers  # one helper for both benchmarks
from demo import CollectiveTally
from llama import Corpus, ModelConfig, get_batch, load_corpus, loss_fn, muon_param_groups
from llama import Llama as LlamaModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
CFG = ModelConfig(dim=64, layers=2, heads=4, ffn=96, seq=64)  # gate/up/down: 6144 elements
BATCH = 4  # sequences per rank
SEED = 0
LR = 3e-3  # AdamW (and Muon's AdamW path)
MUON_LR = 0.02
WD = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
MOMENTUM = 0.95
NS_STEPS = 5
BLOCK = 256
MIN_8BIT = 4096  # bitsandbytes / torchao / ours: fewer elements keep fp32 state

CASES = ("Muon", "AdamW8bit")
LABELS = {
    ("Muon", "ours"): "ours fully_shard + optim_blockwise.Muon",
    ("Muon", "peer"): "FSDP2 + torch.optim.Muon + torch.optim.AdamW",
    ("AdamW8bit", "ours"): "ours fully_shard + optim_blockwise.AdamW8bit",
    ("AdamW8bit", "peer"): "FSDP2 + torchao.optim.AdamW8bit",
}


# -- optimizers ----------------------------------------------------------------------------------


def make_optimizer(case: str, side: str, model: nn.Module) -> Any:
    """The same hyper-parameters on both sides; works on plain and on DTensor parameters."""
    import optim_blockwise as ob

    if case == "Muon":
        hidden, other = muon_param_groups(model)
        if side == "ours":
            return ob.Muon(
                [{"params": hidden}, {"params": other, "use_muon": False, "lr": LR}],
                lr=MUON_LR,
                weight_decay=WD,
                momentum=MOMENTUM,
                nesterov=True,
                ns_steps=NS_STEPS,
                adjust_lr_fn="original",
                ns_dtype=torch.bfloat16,  # torch.optim.Muon runs Newton-Schulz in bf16
                adamw_betas=BETAS,
                adamw_eps=EPS,
            )
        return Optimizers(
            torch.optim.Muon(
                hidden,
                lr=MUON_LR,
                weight_decay=WD,
                momentum=MOMENTUM,
                nesterov=True,
                ns_steps=NS_STEPS,
                adjust_lr_fn="original",
            ),
            torch.optim.AdamW(other, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD),
        )
    if side == "ours":
        return ob.AdamW8bit(
            model.parameters(),
            lr=LR,
            betas=BETAS,
            eps=EPS,
            weight_decay=WD,
            block_size=BLOCK,
            min_8bit_size=MIN_8BIT,
        )
    from torchao.optim import AdamW8bit

    return AdamW8bit(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, block_size=BLOCK
    )


def _opts(opt: Any) -> tuple[torch.optim.Optimizer, ...]:
    return opt.opts if isinstance(opt, Optimizers) else (opt,)


def _inner_bytes(t: torch.Tensor) -> int:
    """Bytes of a tensor; a wrapper subclass (torchao's 8-bit state) counts its inner tensors."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_inner_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def state_bytes(opt: Any) -> int:
    """Optimizer state held by this rank (``step`` counters excluded)."""
    total = 0
    for o in _opts(opt):
        for state in o.state.values():
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    total += _inner_bytes(value)
    return total


def torchao_state_kinds(model: nn.Module, opt: Any) -> dict[str, str]:
    """Per parameter: '8bit' or 'fp32', as torchao decided on this rank."""
    names = {id(p): n for n, p in model.named_parameters()}
    out: dict[str, str] = {}
    for o in _opts(opt):
        for p, state in o.state.items():
            value = state.get("exp_avg")
            if isinstance(value, torch.Tensor):
                local = value.to_local() if isinstance(value, DTensor) else value
                out[names[id(p)]] = "fp32" if type(local) is torch.Tensor else "8bit"
    return out


# -- the two sides -------------------------------------------------------------------------------


@dataclass
class Runner:
    side: str
    model: nn.Module
    opt: Any
    times: list[float] = field(default_factory=list)
    opt_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    calls: list[dict[str, int]] = field(default_factory=list)  # count_collectives per step
    call_bytes: list[dict[str, int]] = field(default_factory=list)


def build(case: str, side: str, cfg: ModelConfig, mesh: DeviceMesh) -> Runner:
    torch.manual_seed(SEED)  # the same initial weights on every rank, side and reference
    model = LlamaModel(cfg)
    if side == "ours":
        import fsdp_engine
        import optim_blockwise as ob

        policy: Any = (
            ob.Muon.block_policy()
            if case == "Muon"
            else ob.AdamW8bit.block_policy(block_size=BLOCK)
        )
        for layer in model.layers:
            fsdp_engine.fully_shard(layer, mesh=mesh, block_policy=policy)
        fsdp_engine.fully_shard(model, mesh=mesh, block_policy=policy)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return Runner(side, model, make_optimizer(case, side, model))


def batches(corpus: Corpus, rank: int, n: int, seq: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [get_batch(corpus.train, gen, BATCH, seq) for _ in range(n)]


def _step(r: Runner, tokens: torch.Tensor) -> tuple[float, float, float]:
    from ragged_dtensor.testing import count_collectives

    dist.barrier()
    with count_collectives() as counter:
        t0 = time.perf_counter()
        loss = loss_fn(r.model, tokens)
        loss.backward()  # type: ignore[no-untyped-call]
        t1 = time.perf_counter()
        r.opt.step()
        r.opt.zero_grad()
        dist.barrier()
        t2 = time.perf_counter()
    r.calls.append(dict(counter.calls))
    r.call_bytes.append(dict(counter.bytes))
    return t2 - t0, t2 - t1, float(loss.detach())


def worker(rank: int, world: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    cfg = CFG.with_vocab(corpus.vocab)
    data = batches(corpus, rank, warmup + steps, cfg.seq)
    out: dict[str, Any] = {}
    for case in CASES:
        runners = [build(case, side, cfg, mesh) for side in ("ours", "peer")]
        tallies: dict[str, Any] = {}
        for i, tokens in enumerate(data):
            for r in runners if i % 2 == 0 else runners[::-1]:
                if i == warmup - 1:  # untimed: every collective at the dispatcher
                    tally = CollectiveTally()
                    with tally:
                        _, _, loss = _step(r, tokens)
                    tallies[r.side] = {"calls": dict(tally.calls), "bytes": dict(tally.bytes)}
                else:
                    total, opt_time, loss = _step(r, tokens)
                    if i >= warmup:
                        r.times.append(total)
                        r.opt_times.append(opt_time)
                r.losses.append(loss)
        res: dict[str, Any] = {}
        for r in runners:
            full = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in r.model.named_parameters()
            }
            res[r.side] = {
                "times": r.times,
                "opt_times": r.opt_times,
                "losses": r.losses,
                "calls": r.calls[-1],  # the last timed step (the same every step after warm-up)
                "call_bytes": r.call_bytes[-1],
                "calls_per_step": [sum(c.values()) for c in r.calls],
                "dispatcher": tallies[r.side],
                "state_bytes": state_bytes(r.opt),
                "params": full if rank == 0 else None,
            }
            if case == "AdamW8bit" and r.side == "peer":
                res[r.side]["torchao_state"] = torchao_state_kinds(r.model, r.opt)
        # Control: every rank trains on rank 0's batches, so every rank's gradient is the
        # one-device gradient of that batch and the optimizer alone separates the two results.
        same = batches(corpus, 0, warmup + steps, cfg.seq)
        for side in ("ours", "peer"):
            r = build(case, side, cfg, mesh)
            for tokens in same:
                loss_fn(r.model, tokens).backward()  # type: ignore[no-untyped-call]
                r.opt.step()
                r.opt.zero_grad()
            full = {  # full_tensor() is a collective: every rank calls it
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in r.model.named_parameters()
            }
            res[side]["params_same_data"] = full if rank == 0 else None
        out[case] = res
        del runners
    return out


# -- single-device references (parent process) ---------------------------------------------------


def reference(
    case: str, side: str, corpus: Corpus, ranks: list[int], n: int
) -> dict[str, torch.Tensor]:
    """The same optimizer class on one process, batch = these ranks' batches concatenated."""
    cfg = CFG.with_vocab(corpus.vocab)
    torch.manual_seed(SEED)
    model = LlamaModel(cfg)
    opt = make_optimizer(case, side, model)
    per_rank = [batches(corpus, r, n, cfg.seq) for r in ranks]
    for i in range(n):
        loss = loss_fn(model, torch.cat([b[i] for b in per_rank]))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def initial_params() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    model = LlamaModel(CFG.with_vocab(len(load_corpus().chars)))
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    return {k: float((a[k] - b[k]).abs().max()) for k in a}


# -- report --------------------------------------------------------------------------------------


def machine() -> dict[str, str]:
    cpu = "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = "?"
    with contextlib.suppress(OSError):
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
    commit = "unknown"
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    import torchao

    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": cpu,
        "nproc": str(os.cpu_count()),
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "python": platform.python_version(),
        "load": load,
        "commit": commit,
    }


Diffs = dict[int, dict[str, dict[str, dict[str, float]]]]


def summarize(
    raw: dict[int, dict[str, Any]], diffs: Diffs, diffs_same: Diffs
) -> list[dict[str, Any]]:
    rows = []
    init = initial_params()
    for world, res in raw.items():
        for case in CASES:
            ours, peer = res[case]["ours"], res[case]["peer"]
            for side in ("ours", "peer"):
                e = res[case][side]
                d = diffs[world][case][side]
                row: dict[str, Any] = {
                    "case": case,
                    "world": world,
                    "side": side,
                    "label": LABELS[(case, side)],
                    "median_ms": 1e3 * statistics.median(e["times"]),
                    "min_ms": 1e3 * min(e["times"]),
                    "opt_median_ms": 1e3 * statistics.median(e["opt_times"]),
                    "opt_min_ms": 1e3 * min(e["opt_times"]),
                    "collectives": sum(e["calls"].values()),
                    "collective_bytes": sum(e["call_bytes"].values()),
                    "collective_kinds": e["calls"],
                    "dispatcher_collectives": sum(e["dispatcher"]["calls"].values()),
                    "dispatcher_bytes": sum(e["dispatcher"]["bytes"].values()),
                    "dispatcher_kinds": e["dispatcher"]["calls"],
                    "state_bytes_rank0": e["state_bytes"],
                    "max_abs_diff_vs_1dev": max(d.values()),
                    "max_abs_diff_vs_1dev_same_data": max(diffs_same[world][case][side].values()),
                    "final_loss": e["losses"][-1],
                }
                moved = {k: float((v - init[k]).abs().max()) for k, v in e["params"].items()}
                worst = max(moved, key=lambda k: moved[k])
                row["max_abs_change_from_init"] = moved[worst]
                row["max_abs_change_tensor"] = worst
                if case == "Muon":
                    hidden = [k for k in d if k.startswith("layers.") and k.endswith("weight")]
                    hidden = [k for k in hidden if len(e["params"][k].shape) == 2]
                    row["max_abs_diff_muon_matrices"] = max(d[k] for k in hidden)
                    row["max_abs_diff_adamw_path"] = max(v for k, v in d.items() if k not in hidden)
                if side == "ours":
                    row["ours_vs_peer_max_abs_diff"] = res[case]["ours_vs_peer_max_abs_diff"]
                if side == "ours":
                    row["paired_step_ratio"] = statistics.median(
                        a / b for a, b in zip(ours["times"], peer["times"], strict=True)
                    )
                    row["paired_opt_ratio"] = statistics.median(
                        a / b for a, b in zip(ours["opt_times"], peer["opt_times"], strict=True)
                    )
                    row["state_ratio"] = ours["state_bytes"] / peer["state_bytes"]
                if case == "AdamW8bit" and side == "peer":
                    kinds = e["torchao_state"]
                    shapes = {k: v.shape for k, v in e["params"].items()}
                    mixed = sorted(
                        k
                        for k, kind in kinds.items()
                        if kind == "fp32"
                        and math.prod(shapes[k]) >= MIN_8BIT
                        and math.prod(shapes[k]) % BLOCK == 0
                    )
                    row["torchao_fp32_but_8bit_on_1dev"] = mixed
                    row["max_abs_diff_those"] = max((d[k] for k in mixed), default=0.0)
                    row["max_abs_diff_others"] = max(
                        (v for k, v in d.items() if k not in mixed), default=0.0
                    )
                rows.append(row)
    return rows


def _kinds(calls: dict[str, int]) -> str:
    return ", ".join(f"{v} {k}" for k, v in sorted(calls.items()))


def markdown(rows: list[dict[str, Any]], info: dict[str, str], args: argparse.Namespace) -> str:
    out = [
        "# Our engine + optimizers vs FSDP2 + torch.optim.Muon / torchao AdamW8bit",
        "",
        f"{info['date']}, {info['nproc']} x {info['cpu']} (load {info['load']}), torch "
        f"{info['torch']}, torchao {info['torchao']}, Python {info['python']}, commit "
        f"{info['commit']}. gloo processes, 1 thread each; model "
        f"dim {CFG.dim}, {CFG.layers} layers, ffn {CFG.ffn}, seq {CFG.seq}, {BATCH} sequences per "
        f"rank; {args.warmup} warm-up + {args.steps} timed steps, both sides alternating step by "
        f"step in the same processes. `python benchmarks/bench_optim_engine.py`.",
        "",
        "| case | world | side | step ms median | min | ours/peer (paired) | opt step ms median "
        "| ours/peer opt (paired) | collectives/step (torch.distributed.*) | coll. KiB/step "
        "| dispatcher collectives/step | state KiB/rank | max abs diff vs 1 device "
        "| same, identical batches on every rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        paired = f"{r['paired_step_ratio']:.2f}x" if "paired_step_ratio" in r else ""
        paired_opt = f"{r['paired_opt_ratio']:.2f}x" if "paired_opt_ratio" in r else ""
        out.append(
            f"| {r['case']} | {r['world']} | {r['label']} | {r['median_ms']:.1f} | "
            f"{r['min_ms']:.1f} | {paired} | {r['opt_median_ms']:.1f} | {paired_opt} | "
            f"{r['collectives']} ({_kinds(r['collective_kinds'])}) | "
            f"{r['collective_bytes'] / 1024:.1f} | {r['dispatcher_collectives']} | "
            f"{r['state_bytes_rank0'] / 1024:.1f} | {r['max_abs_diff_vs_1dev']:.2e} | "
            f"{r['max_abs_diff_vs_1dev_same_data']:.2e} |"
        )
    out += ["", "## Notes", ""]
    for r in rows:
        out.append(
            f"- world {r['world']}, {r['label']}: largest change of a parameter from its initial "
            f"value {r['max_abs_change_from_init']:.2e} (`{r['max_abs_change_tensor']}`)."
        )
        if r["case"] == "Muon":
            out.append(
                f"- world {r['world']}, {r['label']}: max abs diff vs 1 device "
                f"{r['max_abs_diff_muon_matrices']:.2e} on the Muon matrices, "
                f"{r['max_abs_diff_adamw_path']:.2e} on the AdamW-path tensors "
                f"(embedding, head, norms)."
            )
        if "ours_vs_peer_max_abs_diff" in r:
            out.append(
                f"- world {r['world']}, {r['case']}: max abs diff ours vs peer final parameters "
                f"{r['ours_vs_peer_max_abs_diff']:.2e}."
            )
        if "torchao_fp32_but_8bit_on_1dev" in r:
            names = r["torchao_fp32_but_8bit_on_1dev"]
            out.append(
                f"- world {r['world']}: torchao kept **fp32** state on rank 0 for {len(names)} "
                f"tensors that get 8-bit state on one device (global numel >= {MIN_8BIT}, local "
                f"shard smaller; pytorch/ao#4912): max abs diff vs 1 device "
                f"{r['max_abs_diff_those']:.2e} on those, {r['max_abs_diff_others']:.2e} on the "
                f"rest (the divergence reaches every tensor through the forward pass)."
            )
    bound = 2 * (args.warmup + args.steps) * max(LR, MUON_LR * math.sqrt(3))
    if any(r["max_abs_change_from_init"] > bound for r in rows):
        out.append(
            f"- **Anomaly**: a change above {bound:.2f} (twice steps x lr x the largest lr "
            "adjustment) is more than Adam or Muon can move a parameter. Seen with 8-bit state on "
            "the embedding (ours decides on the global 6592 >= 4096 elements; torchao keeps it "
            "fp32 since 6592 is not a multiple of 256): in a block whose absmax is set by a large "
            "gradient, an element's v can quantize to 0 while its m does not, and when its "
            "gradient is 0 (characters absent from a batch) the update is m / eps. A synthetic "
            "block (one gradient of 1, the rest ~1e-2, then zero gradients) reproduces it with "
            "`optim_blockwise.AdamW8bit` and `torchao.optim.AdamW8bit` (updates ~10^4 x lr), not "
            "with `bitsandbytes.optim.AdamW8bit` (updates <= lr)."
        )
    out += [
        "- Step time = forward + backward + optimizer step + zero_grad, barrier before and after, "
        "rank 0's clock. Paired ratio = median over steps of ours_i / peer_i (adjacent steps).",
        "- Collectives/step: `ragged_dtensor.testing.count_collectives` around a timed step "
        "(`torch.distributed.*` calls: FSDP2's and ours, bytes = largest input tensor per call). "
        "The dispatcher column counts every `c10d`/`_c10d_functional` op on one untimed step; it "
        "also sees DTensor's functional collectives (e.g. inside `torch.optim.Muon` on sharded "
        "matrices), which `torch.distributed.*` counting misses.",
        "- State: local tensors of `optimizer.state` on rank 0, `step` counters excluded; "
        "torchao's 8-bit subclasses by their inner tensors (codes, scale, qmap).",
        "- Max abs diff: final full parameters vs the same optimizer class trained on one process "
        "with every rank's batch concatenated, same init, same number of steps. A nonzero value "
        "on our side is the fp32 rounding of a different gradient reduction order (rank-local "
        "means then average vs one global mean), amplified by the optimizer. The last column is "
        "a control: every rank trains on rank 0's batches and the reference on that batch alone, "
        "so all ranks' gradients equal the one-device gradient up to the rounding of the "
        "gradient average (exact at world size 2).",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=16, help="timed steps (>= 8)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    corpus = load_corpus()
    n = args.warmup + args.steps
    raw: dict[int, dict[str, Any]] = {}
    diffs: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    diffs_same: dict[int, dict[str, dict[str, dict[str, float]]]] = {}
    for world in args.worlds:
        start = time.perf_counter()
        per_rank = run_processes(
            worker,
            world,
            args.steps,
            args.warmup,
            timeout=args.timeout,
            env={"TORCHDYNAMO_DISABLE": "1"},
        )
        res = per_rank[0]
        for case in CASES:
            for side in ("ours", "peer"):
                res[case][side]["state_bytes_per_rank"] = [
                    r[case][side]["state_bytes"] for r in per_rank
                ]
        diffs[world] = {
            case: {
                side: max_diff(
                    res[case][side]["params"], reference(case, side, corpus, list(range(world)), n)
                )
                for side in ("ours", "peer")
            }
            for case in CASES
        }
        diffs_same[world] = {
            case: {
                side: max_diff(
                    res[case][side]["params_same_data"], reference(case, side, corpus, [0], n)
                )
                for side in ("ours", "peer")
            }
            for case in CASES
        }
        for case in CASES:
            ours, peer = res[case]["ours"]["params"], res[case]["peer"]["params"]
            res[case]["ours_vs_peer_max_abs_diff"] = max(max_diff(ours, peer).values())
        raw[world] = res
        print(f"world {world}: {time.perf_counter() - start:.0f} s", flush=True)
    rows = summarize(raw, diffs, diffs_same)
    info = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, info, args)
    (out / "bench_optim_engine.md").write_text(table)
    for res in raw.values():  # parameters are summarized as differences, not stored
        for case in CASES:
            for side in ("ours", "peer"):
                res[case][side].pop("params")
                res[case][side].pop("params_same_data")
    payload = {
        "machine": info,
        "args": vars(args),
        "model": CFG.as_dict(),
        "hyper_parameters": {
            "lr": LR,
            "muon_lr": MUON_LR,
            "weight_decay": WD,
            "betas": BETAS,
            "eps": EPS,
            "momentum": MOMENTUM,
            "nesterov": True,
            "ns_steps": NS_STEPS,
            "ns_dtype": "bfloat16",
            "adjust_lr_fn": "original",
            "block_size": BLOCK,
            "batch_per_rank": BATCH,
        },
        "rows": rows,
        "diff_per_tensor": diffs,
        "diff_per_tensor_same_data": diffs_same,
        "raw": raw,
    }
    (out / "bench_optim_engine.json").write_text(json.dumps(payload, indent=1))
    print(table)


if __name__ == "__main__":
    main()
