"""Train a Hugging Face ``transformers`` causal LM with ``fsdp_engine.fully_shard`` on N ranks.

The demo's conventions (``demo.py``) on the models people train: a small random-init config of
``LlamaForCausalLM`` (tied embeddings), ``Qwen3MoeForCausalLM`` or ``GptOssForCausalLM``
(``hf_models.py``; nothing is downloaded), character-level text of ``pydoc_data.topics``,
sharded the torchtitan way (every decoder layer, then the root). Rank 0 shows a progress bar
(loss, tokens/s), then a summary (loss, throughput, step time, peak live memory per rank,
collectives per step) and writes ``hf_loss.png`` and ``hf_summary.json`` into ``--out``.

    python examples/hf_train.py                               # LLaMA, fsdp-engine, 2 ranks
    python examples/hf_train.py --hf-model moe --engine fsdp2 # the same run on torch's FSDP2
    python examples/hf_train.py --engine both --steps 60      # side by side, alternating steps
    python examples/hf_train.py --steps 100 --save runs/hf/ckpt --export runs/hf/exported
    python examples/hf_train.py --compile --gradient-checkpointing
    torchrun --nproc-per-node 2 examples/hf_train.py

``--engine both`` builds the model twice in each process (same init), shards one with each
engine and alternates them step by step on the same batches (the order flips every step), so
both see the same machine load: step-time ratios and peak live memory side by side.
``--export`` turns the last checkpoint into a ``save_pretrained`` directory (safetensors) and
checks that ``AutoModelForCausalLM.from_pretrained`` gives the sharded model's logits bitwise.
Needs the examples' ``hf`` extra: ``pip install -e "examples[hf,demo]"`` (or ``nox -s hf_demo``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hf_models as hf
import torch
import torch.distributed as dist
from demo import ENGINES
from llama import Corpus, load_corpus
from run_tools import (
    CollectiveTally,
    OneLineErrorParser,
    mib,
    persistent_tensors,
    positive_float,
    positive_int,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

ENGINE_CHOICES = (*sorted(ENGINES), "both")


def _fully_shard(engine: str) -> Any:
    if engine == "fsdp-engine":
        import fsdp_engine

        return fsdp_engine.fully_shard
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp.fully_shard


class Run:
    """One engine's model, optimizer and measurements in this process."""

    def __init__(
        self, args: argparse.Namespace, engine: str, corpus: Corpus, mesh: DeviceMesh
    ) -> None:
        self.engine = engine
        config = hf.make_config(
            args.hf_model, vocab=corpus.vocab, seq=args.seq_len, layers=args.layers
        )
        self.model = hf.build_model(config, seed=args.seed, device=mesh.device_type)
        if args.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        if args.compile:  # torchtitan's order: compile each layer, then shard
            hf.compile_layers(self.model, fullgraph=args.hf_model == "llama")
        hf.shard_model(self.model, _fully_shard(engine), mesh=mesh)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1
        )
        self.losses: list[float] = []
        self.val: list[tuple[int, float]] = []
        self.times: list[float] = []
        self.peak = 0
        self.tally = CollectiveTally()

    def step(self, tokens: torch.Tensor, measure: bool) -> torch.Tensor:
        from dbuffer.testing import LiveBytes

        t0 = time.perf_counter()
        if measure:  # one measured step: peak live memory and collectives
            with LiveBytes(seed=persistent_tensors(self.model, self.opt)) as live, self.tally:
                loss = self._step(tokens)
            self.peak = live.peak
        else:
            loss = self._step(tokens)
        if tokens.is_cuda:
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)
        return loss

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        loss = hf.lm_loss(self.model, tokens)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()


def _global_mean(value: torch.Tensor, world: int) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / world


@torch.no_grad()
def _validate(run: Run, batches: list[torch.Tensor], world: int) -> float:
    total = sum(hf.lm_loss(run.model, b) for b in batches)
    assert isinstance(total, torch.Tensor)
    return _global_mean(total / len(batches), world)


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if use_cuda else None
    if device is not None:
        torch.cuda.set_device(device)
    mesh = init_device_mesh("cuda" if use_cuda else "cpu", (world,))
    corpus = load_corpus()
    engines = sorted(ENGINES) if args.engine == "both" else [args.engine]
    runs = [Run(args, engine, corpus, mesh) for engine in engines]
    start = _resume(runs[0], args) if args.resume else 0
    size = args.batch_size * world  # the global batch: see hf_models [Note: data ...]
    val_batches = [
        hf.rank_rows(
            hf.global_batch(corpus, 10_000 + i, size=size, seq=args.seq_len, split="val"),
            rank,
            world,
        ).to(mesh.device_type)
        for i in range(2)
    ]
    progress = _progress(args, start) if rank == 0 else None
    measure_step = start + min(2, args.steps - start - 1)
    for step in range(start, args.steps):
        batch = hf.global_batch(corpus, step, size=size, seq=args.seq_len, seed=args.seed)
        tokens = hf.rank_rows(batch, rank, world).to(mesh.device_type)
        order = runs if step % 2 == 0 else runs[::-1]  # alternate who goes first
        for run in order:
            loss = run.step(tokens, measure=step == measure_step)
            run.losses.append(_global_mean(loss, world))
            if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
                run.val.append((step + 1, _validate(run, val_batches, world)))
        if args.save and ((step + 1) % args.save_every == 0 or step == args.steps - 1):
            _save(runs[0], args, step + 1)
        if progress is not None:
            recent = statistics.median(runs[0].times[-10:])
            tps = args.batch_size * args.seq_len * world / recent
            progress.set_postfix(loss=f"{runs[0].losses[-1]:.3f}", tok_s=f"{tps:,.0f}")
            progress.update(1)
    if progress is not None:
        progress.close()
    exported = _export(runs[0], args, rank, corpus) if args.export else None
    record = {
        "rank": rank,
        "runs": {
            r.engine: {
                "losses": r.losses,
                "val": r.val,
                "times": r.times,
                "peak_live_bytes": r.peak,
                "collectives": dict(r.tally.calls),
                "collective_bytes": dict(r.tally.bytes),
            }
            for r in runs
        },
        "exported": exported,
    }
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        report(args, records, runs[0].model, start)
    return record


def _progress(args: argparse.Namespace, start: int) -> Any:
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise SystemExit(
            "examples/hf_train.py needs tqdm for its progress bar: "
            "pip install -e 'examples[hf,demo]' (or run `nox -s hf_demo`)"
        ) from exc
    label = "both engines" if args.engine == "both" else ENGINES[args.engine]
    return tqdm(total=args.steps, initial=start, desc=label, unit="step", file=sys.stderr)


def _state(run: Run) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {
        "model": get_model_state_dict(run.model),
        "optim": get_optimizer_state_dict(run.model, run.opt),
    }


def _save(run: Run, args: argparse.Namespace, step: int) -> Path:
    import fsdp_engine

    path = Path(args.save) / f"step_{step:08d}"
    meta = hf.checkpoint_metadata(run.model, step=step, hf_model=args.hf_model)
    return fsdp_engine.save_checkpoint(_state(run), path, metadata=meta)


def _resume(run: Run, args: argparse.Namespace) -> int:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import fsdp_engine

    path = fsdp_engine.latest_checkpoint(args.resume) or Path(args.resume)
    state = _state(run)
    info = fsdp_engine.load_checkpoint(state, path)
    set_model_state_dict(run.model, state["model"])
    set_optimizer_state_dict(run.model, run.opt, state["optim"])
    step = int(info["metadata"]["step"])
    if step >= args.steps:
        raise SystemExit(f"--resume {path}: already at step {step} of --steps {args.steps}")
    return step


def _export(run: Run, args: argparse.Namespace, rank: int, corpus: Corpus) -> dict[str, Any]:
    """Rank 0 exports the last checkpoint and compares the reloaded model's logits with the
    sharded model's on the same input (bitwise for eager layers; compiled layers run other
    kernels, so the difference is reported)."""
    import fsdp_engine

    probe = hf.global_batch(corpus, 20_000, size=2, seq=args.seq_len, split="val")
    with torch.no_grad():
        sharded = run.model(input_ids=probe.to(args.mesh_device)).logits.cpu()
    result: dict[str, Any] = {}
    if rank == 0:
        tf = hf.require_transformers()
        checkpoint = fsdp_engine.latest_checkpoint(args.save)
        assert checkpoint is not None
        out = hf.export_pretrained(checkpoint, args.export)
        reloaded = tf.AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            logits = reloaded(input_ids=probe).logits
        result = {
            "checkpoint": str(checkpoint),
            "dir": str(out),
            "files": sorted(p.name for p in out.iterdir()),
            "bitwise_equal_logits": bool(torch.equal(logits, sharded)),
            "max_abs_logit_difference": float((logits - sharded).abs().max()),
        }
    dist.barrier()
    return result


def report(
    args: argparse.Namespace, records: list[dict[str, Any]], model: nn.Module, start: int
) -> None:
    cfg = model.config
    params = sum(p.numel() for p in model.parameters())
    first = next(iter(records[0]["runs"].values()))
    steady_from = min(3, max(len(first["times"]) - 1, 0))
    lines = [
        f"model {type(model).__name__.removeprefix('FSDP')} ({args.hf_model}: {params:,} "
        f"parameters, hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, vocab "
        f"{cfg.vocab_size}, tied "
        f"{cfg.tie_word_embeddings}), world size {args.world}, batch {args.batch_size}/rank x "
        f"seq {args.seq_len}, AdamW lr {args.lr}, steps {start + 1}-{args.steps}"
        + (", compiled layers" if args.compile else "")
        + (", gradient checkpointing" if args.gradient_checkpointing else ""),
    ]
    summary: dict[str, Any] = {"args": vars(args), "model": json.loads(cfg.to_json_string())}
    for engine in records[0]["runs"]:
        r0 = records[0]["runs"][engine]
        steady = r0["times"][steady_from:]
        step_s = statistics.median(steady)
        tps = args.batch_size * args.seq_len * args.world / step_s
        calls = sum(r0["collectives"].values())
        kinds = ", ".join(f"{v} {k}" for k, v in sorted(r0["collectives"].items()))
        peaks = [r["runs"][engine]["peak_live_bytes"] for r in records]
        lines += [
            f"[{ENGINES[engine]}]",
            f"  final loss        train {statistics.mean(r0['losses'][-10:]):.4f} (mean of last "
            f"10 steps), val {r0['val'][-1][1]:.4f} (first step {r0['losses'][0]:.4f})",
            f"  throughput        {tps:,.0f} tokens/s (step {step_s * 1e3:.1f} ms median, "
            f"{min(steady) * 1e3:.1f} ms min)",
            "  peak live memory  " + ", ".join(f"rank {i}: {mib(p)}" for i, p in enumerate(peaks)),
            f"  collectives/step  {calls} ({kinds})",
        ]
        summary[engine] = {
            "losses": r0["losses"],
            "val": r0["val"],
            "step_ms": [t * 1e3 for t in r0["times"]],
            "step_ms_median": step_s * 1e3,
            "step_ms_min": min(steady) * 1e3,
            "tokens_per_s": tps,
            "peak_live_bytes": peaks,
            "collectives_per_step": r0["collectives"],
        }
    if args.engine == "both":
        ours, theirs = (records[0]["runs"][e] for e in ("fsdp-engine", "fsdp2"))
        ratios = [a / b for a, b in zip(ours["times"], theirs["times"], strict=True)][steady_from:]
        peak_ratio = max(r["runs"]["fsdp-engine"]["peak_live_bytes"] for r in records) / max(
            r["runs"]["fsdp2"]["peak_live_bytes"] for r in records
        )
        gap = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"], strict=True))
        side = {
            "step_ratio_median": statistics.median(ratios),
            # the least-disturbed step of each: robust to load spikes on a shared machine
            "step_ratio_of_mins": min(ours["times"][steady_from:])
            / min(theirs["times"][steady_from:]),
            "peak_live_ratio": peak_ratio,
            "max_loss_difference": gap,
        }
        lines += [
            "[side by side: fsdp-engine / FSDP2, alternating steps in this run]",
            f"  step time         {side['step_ratio_median']:.2f}x median of the paired ratios, "
            f"{side['step_ratio_of_mins']:.2f}x ratio of the minimum steps",
            f"  peak live memory  {peak_ratio:.2f}x (largest rank each)",
            f"  losses            largest difference {gap:.2e}",
        ]
        summary["side_by_side"] = side
    exported = records[0]["exported"]
    if exported:
        lines.append(
            f"export            {exported['dir']} ({', '.join(exported['files'])}) from "
            f"{exported['checkpoint']}; from_pretrained logits bitwise equal to the sharded "
            f"model's: {exported['bitwise_equal_logits']} (max |diff| "
            f"{exported['max_abs_logit_difference']:.1e})"
        )
        summary["export"] = exported
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_summary.json").write_text(json.dumps(summary, indent=1))
    _plot(args, summary, out / "hf_loss.png")


def _plot(args: argparse.Namespace, summary: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        print(f"(matplotlib is not installed: no {path.name}; pip install -e 'examples[demo]')")
        return
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    for engine in (e for e in ENGINES if e in summary):
        losses = summary[engine]["losses"]
        first = args.steps - len(losses) + 1
        style = "--" if engine == "fsdp2" else "-"  # dashed: equal curves stay visible
        steps = range(first, args.steps + 1)
        ax.plot(steps, losses, style, lw=1, label=f"{ENGINES[engine]} train")
        if summary[engine]["val"]:
            at, vals = zip(*summary[engine]["val"], strict=True)
            ax.plot(at, vals, style, marker="o", ms=3, label=f"{ENGINES[engine]} validation")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(f"Hugging Face {args.hf_model}, {args.world} ranks", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path} and {path.with_name('hf_summary.json')}")


def parse(argv: list[str] | None = None, env: dict[str, str] | None = None) -> argparse.Namespace:
    env = dict(os.environ) if env is None else env
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hf-model", choices=hf.HF_MODELS, default="llama")
    p.add_argument("--engine", choices=ENGINE_CHOICES, default="fsdp-engine")
    p.add_argument("--world-size", type=positive_int, default=None, help="ranks to spawn (2)")
    p.add_argument("--steps", type=positive_int, default=100)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank/step")
    p.add_argument("--seq-len", type=positive_int, default=128)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=positive_int, default=25)
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--compile", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--save", default=None, help="checkpoint folder (a step_N directory each save)")
    p.add_argument("--save-every", type=positive_int, default=50)
    p.add_argument("--resume", default=None, help="a checkpoint folder or directory to resume")
    p.add_argument("--export", default=None, help="save_pretrained directory after training")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default="runs/hf", help="folder for the PNG and the JSON summary")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"argument --steps: must be at least 2, got {args.steps}")
    if args.engine == "both" and (args.save or args.resume or args.export):
        p.error("argument --engine: both compares engines; --save/--resume/--export need one")
    if args.export and not args.save:
        p.error("argument --export: needs --save (the checkpoint it exports)")
    if args.hf_model not in hf.available_models():
        p.error(f"argument --hf-model: {args.hf_model} needs a newer transformers ({hf.INSTALL})")
    longest = len(load_corpus().val) - 1
    if args.seq_len > longest:
        p.error(f"argument --seq-len: {args.seq_len} is longer than the validation text allows")
    under_torchrun = "RANK" in env and "WORLD_SIZE" in env
    if under_torchrun:
        world = int(env["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world:
            p.error(f"argument --world-size: {args.world_size} conflicts with torchrun's {world}")
        args.world_size = world
    elif args.world_size is None:
        args.world_size = 2
    args.torchrun = under_torchrun
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    args.world = args.world_size
    if args.torchrun:  # this process is one rank
        backend = "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
        args.mesh_device = "cuda" if backend == "nccl" else "cpu"
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
        try:
            train(dist.get_rank(), dist.get_world_size(), args)
        finally:
            dist.destroy_process_group()
        return
    from ragged_dtensor.testing import run_processes

    args.device = args.mesh_device = "cpu"  # self-spawned ranks: gloo on this host
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run_processes(train, args.world, args, timeout=args.timeout, env=env)


if __name__ == "__main__":
    main()
