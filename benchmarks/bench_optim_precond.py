"""Shampoo and SOAP beside AdamW and Muon on our fully_shard: optimizer-step time, state memory.

One run per world size (2 and 4, real gloo processes on this CPU). In each process, every
optimizer in turn trains its own copy of the same LLaMA-like model (``examples/llama.py``,
``--model`` preset, same initial weights and batches), sharded per layer + root by
``fsdp_engine.fully_shard`` with that optimizer's block policy:

- ``torch.optim.AdamW`` (no policy), ``optim_blockwise.Muon`` (``Muon.block_policy()``, hidden
  matrices Muon, the rest its AdamW path);
- ``optim_blockwise.Shampoo`` (Adam grafting) and ``optim_blockwise.SOAP`` on every parameter
  with ``Shampoo.block_policy(max_preconditioner_dim)``: every preconditioner tile is whole on
  one rank, the step runs no collective;
- ``Shampoo, no policy``: the same Shampoo on the engine's default layout, where rank boundaries
  cut tiles, which then go through the owner exchange (what the policy saves).

Per optimizer and world size: forward+backward time and optimizer-step time (barriers around
each, rank 0's clock; median over the timed steps, and the step's mean, which carries the root /
eigenbasis refresh every ``precondition_frequency`` steps), the step as a share of
forward+backward, collectives per optimizer step, and the optimizer state in bytes per parameter
(all ranks' local state tensors over the model's parameter count).

Writes ``bench_optim_precond.md`` and ``.json`` into ``--out``. ``--readme`` then fills the
marked table of the optim-blockwise README from that JSON and the convergence benchmark's
``convergence.json`` (``--convergence``); ``--from-json`` only regenerates the table:

    python benchmarks/bench_optim_precond.py [--out results] [--worlds 2 4] [--steps 20]
    python benchmarks/bench_optim_precond.py --from-json --readme packages/optim-blockwise/README.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import torch
import torch.distributed as dist
from llama import PRESETS, get_batch, load_corpus, loss_fn, muon_param_groups
from llama import Llama as LlamaModel
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

ROOT = Path(__file__).resolve().parent.parent
WD = 0.1
BETAS = (0.9, 0.95)
FREQ = 10
MAX_DIM = 1024
KINDS = ("AdamW", "Muon", "Shampoo", "SOAP", "Shampoo, no policy")


def make(kind: str, model: nn.Module, lr: float) -> Any:
    import optim_blockwise as ob

    if kind == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, weight_decay=WD)
    if kind == "Muon":
        hidden, other = muon_param_groups(model)
        return ob.Muon(
            [{"params": hidden}, {"params": other, "use_muon": False}],
            lr=lr,
            weight_decay=WD,
            adjust_lr_fn="match_rms_adamw",
            adamw_betas=BETAS,
        )
    if kind.startswith("Shampoo"):
        return ob.Shampoo(
            model.parameters(),
            lr=lr,
            betas=BETAS,
            weight_decay=WD,
            precondition_frequency=FREQ,
            max_preconditioner_dim=MAX_DIM,
            grafting_beta2=BETAS[1],
        )
    return ob.SOAP(
        model.parameters(),
        lr=lr,
        betas=BETAS,
        weight_decay=WD,
        precondition_frequency=FREQ,
        max_preconditioner_dim=MAX_DIM,
    )


def policy(kind: str) -> Any:
    import optim_blockwise as ob

    if kind == "Muon":
        return ob.Muon.block_policy()
    if kind in ("Shampoo", "SOAP"):
        return ob.Shampoo.block_policy(MAX_DIM)
    return None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def state_bytes(opt: torch.optim.Optimizer) -> int:
    total = 0
    for state in opt.state.values():
        for key, value in state.items():
            if key != "step" and isinstance(value, torch.Tensor):
                local = _local(value)
                total += local.numel() * local.element_size()
    return total


def worker(rank: int, world: int, model_name: str, steps: int, warmup: int) -> dict[str, Any]:
    import fsdp_engine

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    cfg = PRESETS[model_name].with_vocab(corpus.vocab)
    gen = torch.Generator().manual_seed(1000 + rank)
    data = [get_batch(corpus.train, gen, 8, cfg.seq) for _ in range(warmup + steps)]
    out: dict[str, Any] = {}
    for kind in KINDS:
        torch.manual_seed(0)
        model = LlamaModel(cfg)
        n_params = sum(p.numel() for p in model.parameters())
        extra = {} if policy(kind) is None else {"block_policy": policy(kind)}
        for layer in model.layers:
            fsdp_engine.fully_shard(layer, mesh=mesh, **extra)
        fsdp_engine.fully_shard(model, mesh=mesh, **extra)
        opt = make(kind, model, 3e-3)
        fwd_bwd, step_t, collectives, losses = [], [], [], []
        for i, tokens in enumerate(data):
            dist.barrier()
            t0 = time.perf_counter()
            loss = loss_fn(model, tokens)
            loss.backward()  # type: ignore[no-untyped-call]
            dist.barrier()
            t1 = time.perf_counter()
            opt.step()
            dist.barrier()
            t2 = time.perf_counter()
            opt.zero_grad()
            if i >= warmup:
                fwd_bwd.append(t1 - t0)
                step_t.append(t2 - t1)
                collectives.append(getattr(opt, "last_step_stats", {}).get("collectives", 0))
            losses.append(float(loss.detach()))
        out[kind] = {
            "fwd_bwd_ms": 1000 * statistics.median(fwd_bwd),
            "step_ms": 1000 * statistics.median(step_t),
            "step_mean_ms": 1000 * statistics.mean(step_t),
            "collectives": max(collectives),
            "state_bytes": state_bytes(opt),
            "n_params": n_params,
            "final_loss": losses[-1],
        }
    return out


CONVERGENCE_NAMES = {
    "AdamW": "torch AdamW",
    "Muon": "ours Muon",
    "Shampoo": "ours Shampoo",
    "SOAP": "ours SOAP",
}
MARK = "shampoo_soap"


def readme_section(data: dict[str, Any], convergence: dict[str, Any] | None) -> str:
    """The README table: validation loss (convergence benchmark) beside the costs on fully_shard."""
    conv = {r["name"]: r for r in (convergence or {}).get("rows", [])}
    worlds = [int(w) for w in data["rows"]]
    steps = convergence["args"]["steps"] if convergence else "?"
    head = f"| optimizer | val loss, {steps} steps (mean; min / max) |"
    rule = "|---|---|"
    for w in worlds:
        head += f" step ms, ws {w} (median / mean) | step / fwd+bwd, ws {w} |"
        rule += "---|---|"
    head += " collectives / step | state bytes / param |"
    rule += "---|---|"
    lines = []
    if convergence is not None:
        a = convergence["args"]
        lines.append(
            f"Validation loss: `benchmarks/bench_optim_convergence.py` (tiny LLaMA-like char model "
            f"on `pydoc_data.topics`, {a['steps']} steps, {a['seeds']} seeds, 1 thread, lr tuned "
            f"per optimizer: AdamW {a['lr']}, Muon matrices {a['muon_lr']}, Shampoo "
            f"{a['shampoo_lr']}, SOAP {a['soap_lr']}; load average at the end "
            f"{convergence['load']})."
        )
    lines.append(
        f"Costs: `benchmarks/bench_optim_precond.py` on our `fully_shard` (demo model preset "
        f"{data['args']['model']!r}, gloo, 1 thread per rank, {data['args']['steps']} timed steps, "
        f"preconditioners refreshed every {FREQ} steps, so the mean carries the refresh; "
        f"{data['info']}). State: all ranks' optimizer state over the parameter count."
    )
    lines += ["", head, rule]
    for kind in KINDS:
        c = conv.get(CONVERGENCE_NAMES.get(kind, ""))
        loss = (
            f"{c['final_mean']:.3f} ({min(c['finals']):.3f} / {max(c['finals']):.3f})"
            if c
            else ("as Shampoo" if kind.startswith("Shampoo") else "-")
        )
        row = f"| {kind} | {loss} |"
        for w in worlds:
            r = data["rows"][str(w)][kind]
            row += (
                f" {r['step_ms']:.1f} / {r['step_mean_ms']:.1f} "
                f"| {r['step_mean_ms'] / r['fwd_bwd_ms']:.2f} |"
            )
        col = " / ".join(str(data["rows"][str(w)][kind]["collectives"]) for w in worlds)
        first = data["rows"][str(worlds[0])][kind]
        row += f" {col} | {first['state_bytes'] / first['n_params']:.2f} |"
        lines.append(row)
    return "\n".join(lines)


def write_readme(path: Path, section: str) -> None:
    text = path.read_text()
    begin = f"<!-- generated: {MARK} (benchmarks/bench_optim_precond.py --readme) -->"
    end = f"<!-- end generated: {MARK} -->"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: markers {begin!r} ... {end!r} not found")
    path.write_text(pattern.sub(lambda _: f"{begin}\n{section}\n{end}", text))


def main(argv: list[str] | None = None) -> None:
    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--model", choices=sorted(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=20, help="timed steps (>= 2 root refreshes)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--from-json", action="store_true", help="reuse --out's JSON, run nothing")
    p.add_argument("--readme", default=None, help="README whose marked table to write")
    p.add_argument(
        "--convergence",
        default=str(
            ROOT / "packages/optim-blockwise/benchmarks/results/shampoo_soap/convergence.json"
        ),
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.from_json:
        data = json.loads((out / "bench_optim_precond.json").read_text())
    else:
        rows: dict[str, dict[str, Any]] = {}
        for world in args.worlds:
            start = time.perf_counter()
            per_rank = run_processes(
                worker, world, args.model, args.steps, args.warmup, timeout=args.timeout
            )
            res = per_rank[0]
            for kind in KINDS:
                res[kind]["state_bytes"] = sum(r[kind]["state_bytes"] for r in per_rank)
            rows[str(world)] = res
            print(f"world {world}: {time.perf_counter() - start:.0f} s", flush=True)
        load = "?"
        with contextlib.suppress(OSError):
            load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        info = (
            f"{datetime.now(UTC):%Y-%m-%d %H:%M UTC}, {os.cpu_count()} CPUs, torch "
            f"{torch.__version__}, load average at the end {load}"
        )
        data = {
            "args": {"model": args.model, "steps": args.steps, "warmup": args.warmup},
            "info": info,
            "rows": rows,
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_optim_precond.json").write_text(json.dumps(data, indent=1) + "\n")
        lines = [
            f"{info}; gloo, fp32, 1 thread per rank; model preset {args.model!r}; {args.steps} "
            f"timed steps after {args.warmup}; precondition_frequency {FREQ}. "
            "`python benchmarks/bench_optim_precond.py`.",
            "",
            "| optimizer | world | fwd+bwd (ms) | step median (ms) | step mean (ms) "
            "| step / fwd+bwd | collectives / step | state (bytes/param) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for world, res in rows.items():
            for kind in KINDS:
                r = res[kind]
                lines.append(
                    f"| {kind} | {world} | {r['fwd_bwd_ms']:.1f} | {r['step_ms']:.1f} "
                    f"| {r['step_mean_ms']:.1f} | {r['step_mean_ms'] / r['fwd_bwd_ms']:.2f} "
                    f"| {r['collectives']} | {r['state_bytes'] / r['n_params']:.2f} |"
                )
        (out / "bench_optim_precond.md").write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
    if args.readme:
        conv_path = Path(args.convergence)
        convergence = json.loads(conv_path.read_text()) if conv_path.exists() else None
        write_readme(Path(args.readme), readme_section(data, convergence))
        print(f"wrote the {MARK} table of {args.readme}")


if __name__ == "__main__":
    main()
