"""The main job: train a small LLaMA-like model with ``fsdp_engine.fully_shard`` on N ranks.

Character-level text from ``pydoc_data.topics`` (ships with CPython; nothing is downloaded).
One ``fully_shard`` per decoder layer plus one for the root, gloo on CPU (NCCL on GPUs), each rank
its own batches. Rank 0 shows a tqdm progress bar (rate, ETA, loss, tokens/s) and at the end a
summary: final train and validation loss, throughput, peak live memory per rank, collectives per
step, padding of the planned buffers; it writes ``demo_loss.png`` (with matplotlib) and
``demo_summary.json`` into ``--out`` (default ``runs/demo``, git-ignored).

After ``nox -s dev`` and ``source .venv/bin/activate`` (see the README), on this machine (the
script spawns its ranks itself)::

    python examples/demo.py                          # 2 ranks, AdamW, ~1 minute on 2 cores
    python examples/demo.py --optimizer muon --steps 300 --model small
    python examples/demo.py --engine fsdp2           # the same run with torch's FSDP2

Across processes or machines it is plain torchrun (the script never assumes one host; the world
size is torchrun's, so ``--world-size`` must not disagree with it)::

    torchrun --nproc-per-node 2 examples/demo.py
    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        examples/demo.py --model medium
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, cast

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist
from llama import (
    PRESETS,
    Corpus,
    Llama,
    ModelConfig,
    get_batch,
    load_corpus,
    loss_fn,
    muon_param_groups,
)
from run_tools import (
    CollectiveTally,
    OneLineErrorParser,
    mib,
    non_negative_int,
    persistent_tensors,
    positive_float,
    positive_int,
)
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

OPTIMIZERS = ("adamw", "muon", "adamw8bit", "shampoo", "soap")
# what --engine names, and how the summary and the plot name it
ENGINES = {"fsdp-engine": "fsdp_engine.fully_shard", "fsdp2": "torch FSDP2 (fully_shard)"}


# -- measurement -----------------------------------------------------------------------------


# -- the run -----------------------------------------------------------------------------------


def build(
    args: argparse.Namespace, corpus: Corpus, mesh: DeviceMesh, device: torch.device
) -> tuple[nn.Module, Any]:
    cfg = PRESETS[args.model].with_vocab(corpus.vocab)
    if args.seq_len:
        cfg = type(cfg)(**{**cfg.as_dict(), "seq": args.seq_len})
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = Llama(cfg).to(device)
    import torch.distributed.fsdp as torch_fsdp

    import fsdp_engine
    import optim_blockwise as ob

    api: Any = fsdp_engine if args.engine == "fsdp-engine" else torch_fsdp  # same signatures
    fully_shard = api.fully_shard
    mp = (
        api.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mixed_precision == "bf16"
        else api.MixedPrecisionPolicy()
    )
    extra: dict[str, Any] = {}
    if args.engine == "fsdp-engine":
        if args.optimizer == "adamw8bit":
            extra["block_policy"] = ob.AdamW8bit.block_policy(block_size=256)
        elif args.optimizer == "muon":
            extra["block_policy"] = ob.Muon.block_policy()
        elif args.optimizer in ("shampoo", "soap"):  # every preconditioner tile on one rank
            extra["block_policy"] = ob.Shampoo.block_policy()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, **extra)
    fully_shard(model, mesh=mesh, mp_policy=mp, **extra)

    betas = (0.9, 0.95)
    opt: Any
    if args.optimizer == "adamw":
        # weight decay on matrices, none on norms; ours steps flat runs of each group's shard
        decay = [p for p in model.parameters() if p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        adamw = ob.FlatAdamW if args.engine == "fsdp-engine" else torch.optim.AdamW
        opt = adamw(groups, lr=args.lr, betas=betas)
    elif args.optimizer == "adamw8bit":
        opt = ob.AdamW8bit(model.parameters(), lr=args.lr, betas=betas, weight_decay=0.1)
    elif args.optimizer in ("shampoo", "soap"):
        kind = ob.Shampoo if args.optimizer == "shampoo" else ob.SOAP
        opt = kind(model.parameters(), lr=args.lr, betas=betas, weight_decay=0.1)
    else:
        hidden, other = muon_param_groups(model)
        opt = ob.Muon(
            [{"params": hidden}, {"params": other, "use_muon": False}],
            lr=args.lr,
            weight_decay=0.1,
            adjust_lr_fn="match_rms_adamw",  # Moonlight scaling: Muon reuses AdamW's lr
            adamw_betas=betas,
        )
    return model, opt


def _padding(model: nn.Module, engine: str, world: int) -> tuple[int, int]:
    """(padding elements, buffer elements) over all groups, per the engine's layout."""
    pad = total = 0
    if engine == "fsdp-engine":
        import fsdp_engine

        plans = {}
        for m in model.modules():
            if isinstance(m, fsdp_engine.FSDPModule) and (found := m.shard_plan()) is not None:
                plans[id(found)] = found
        for plan in plans.values():
            pad += int(plan.padding)
            total += int(plan.shard_size) * world
    else:  # FSDP2 pads each parameter's dim 0 to a multiple of the world size
        for p in model.parameters():
            rows = p.shape[0] if p.dim() else 1
            row = p.numel() // max(rows, 1)
            padded = math.ceil(rows / world) * world * row
            pad += padded - p.numel()
            total += padded
    return pad, total


def train(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    use_cuda = torch.cuda.is_available() and args.device != "cpu"
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        if use_cuda
        else (torch.device("cpu"))
    )
    if use_cuda:
        torch.cuda.set_device(device)
    mesh = init_device_mesh(device.type, (world,))
    corpus = load_corpus()
    model, opt = build(args, corpus, mesh, device)
    cfg = cast(ModelConfig, model.cfg)
    seq = cfg.seq
    gen = torch.Generator().manual_seed(1000 + rank)  # each rank its own data
    val_gen = torch.Generator().manual_seed(7)
    val_batches = [get_batch(corpus.val, val_gen, args.batch_size, seq) for _ in range(4)]

    losses: list[float] = []
    val_curve: list[tuple[int, float]] = []
    times: list[float] = []
    tally = CollectiveTally()
    peak = 0
    from dbuffer.testing import CopiedBytes, LiveBytes

    copied = 0
    measure_step = min(2, args.steps - 1)
    tokens_per_step = args.batch_size * seq * world
    progress = _progress_bar(args) if rank == 0 else None
    start_all = time.perf_counter()
    for step in range(args.steps):
        tokens = get_batch(corpus.train, gen, args.batch_size, seq).to(device)
        t0 = time.perf_counter()
        if step == measure_step:  # one measured step: live memory, collectives, copies
            with (
                LiveBytes(seed=persistent_tensors(model, opt)) as live,
                CopiedBytes() as copies,
                tally,
            ):
                loss = _step(model, opt, tokens)
            peak, copied = live.peak, copies.total
        else:
            loss = _step(model, opt, tokens)
        if use_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        value = loss.detach().clone()
        dist.all_reduce(value)  # the global mean loss (one tiny all-reduce; not in the tally)
        losses.append(value.item() / world)
        if (step + 1) % args.eval_every == 0 or step == args.steps - 1:
            val_curve.append((step + 1, _validate(model, val_batches, device, world)))
        if progress is not None:
            recent = statistics.median(times[-10:])
            progress.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step / recent:,.0f}")
            progress.update(1)
    wall = time.perf_counter() - start_all
    if progress is not None:
        progress.close()
    sample = _generate(model, corpus, args.sample, device, seq)  # every rank: same greedy text
    pad, buffer = _padding(model, args.engine, world)
    record = {
        "rank": rank,
        "losses": losses,
        "val": val_curve,
        "times": times,
        "wall_s": wall,
        "peak_live_bytes": peak,
        "copied_bytes": copied,
        "collectives": dict(tally.calls),
        "collective_bytes": dict(tally.bytes),
        "padding": pad,
        "buffer": buffer,
        "tokens_per_step": tokens_per_step,
        "sample": sample,
    }
    records: list[Any] = [None] * world
    dist.all_gather_object(records, record)
    if rank == 0:
        report(args, records, corpus, cfg.as_dict())
    return record


def _step(model: nn.Module, opt: torch.optim.Optimizer, tokens: torch.Tensor) -> torch.Tensor:
    loss = loss_fn(model, tokens)
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad()
    return loss.detach()


@torch.no_grad()
def _validate(
    model: nn.Module, batches: list[torch.Tensor], device: torch.device, world: int
) -> float:
    total = torch.zeros((), device=device)
    for tokens in batches:
        total += loss_fn(model, tokens.to(device))
    dist.all_reduce(total)
    return total.item() / (len(batches) * world)


@torch.no_grad()
def _generate(model: nn.Module, corpus: Corpus, length: int, device: torch.device, seq: int) -> str:
    """Greedy continuation of a fixed prompt (all ranks run it: the forward has collectives)."""
    prompt = "The "
    index = {c: i for i, c in enumerate(corpus.chars)}
    tokens = torch.tensor([[index[c] for c in prompt]], device=device)
    for _ in range(length):
        logits = model(tokens[:, -seq:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return corpus.decode(tokens[0].cpu())


def _progress_bar(args: argparse.Namespace) -> Any:
    """Rank 0's progress line: tqdm's (rate, ETA), with the loss and tokens/s as its postfix."""
    try:
        from tqdm.auto import tqdm
    except ImportError as exc:
        raise SystemExit(
            "examples/demo.py needs tqdm for its progress bar: pip install -e 'examples[demo]' "
            "(or run `nox -s dev` / `nox -s demo`)"
        ) from exc
    return tqdm(total=args.steps, desc=ENGINES[args.engine], unit="step", file=sys.stderr)


def report(
    args: argparse.Namespace, records: list[dict[str, Any]], corpus: Corpus, cfg: dict[str, Any]
) -> None:
    r0 = records[0]
    steady = r0["times"][min(3, len(r0["times"]) - 1) :]
    step_s = statistics.median(steady)
    tps = r0["tokens_per_step"] / step_s
    train_final = statistics.mean(r0["losses"][-10:])
    val_final = r0["val"][-1][1]
    calls = sum(r0["collectives"].values())
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(r0["collectives"].items()))
    lines = [
        f"engine {ENGINES[args.engine]}, optimizer {args.optimizer}, world size {args.world}, "
        f"model {args.model} (dim {cfg['dim']}, {cfg['layers']} layers, experts {cfg['experts']}, "
        f"seq {cfg['seq']}, vocab {cfg['vocab']}), batch {args.batch_size}/rank, "
        f"precision {args.mixed_precision}",
        f"final loss        train {train_final:.4f} (mean of last 10 steps), "
        f"val {val_final:.4f} (first step {r0['losses'][0]:.4f})",
        f"throughput        {tps:,.0f} tokens/s ({step_s * 1e3:.0f} ms/step median, "
        f"{r0['wall_s']:.1f} s for {len(r0['losses'])} steps)",
        "peak live memory  "
        + ", ".join(f"rank {r['rank']}: {mib(r['peak_live_bytes'])}" for r in records),
        f"collectives/step  {calls} ({kinds}); {mib(sum(r0['collective_bytes'].values()))} "
        "sent by rank 0",
        f"bytes copied      {mib(r0['copied_bytes'])} per step (rank 0; copy-like ops)",
        f"padding           {r0['padding']:,} of {r0['buffer']:,} buffer elements "
        f"({100 * r0['padding'] / max(r0['buffer'], 1):.3f}%)",
    ]
    if r0["sample"]:
        lines.append(f"sample (greedy)   {r0['sample']!r}")
    print("\n".join(lines))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {
        "args": vars(args),
        "model": cfg,
        "final_train_loss": train_final,
        "final_val_loss": val_final,
        "tokens_per_s": tps,
        "step_ms_median": step_s * 1e3,
        "peak_live_bytes": [r["peak_live_bytes"] for r in records],
        "collectives_per_step": r0["collectives"],
        "collective_bytes_per_step": r0["collective_bytes"],
        "copied_bytes_per_step": r0["copied_bytes"],
        "padding_elements": r0["padding"],
        "buffer_elements": r0["buffer"],
        "losses": r0["losses"],
        "val": r0["val"],
        "sample": r0["sample"],
    }
    (out / "demo_summary.json").write_text(json.dumps(summary, indent=1))
    _plot(args, r0, out / "demo_loss.png")


def _plot(args: argparse.Namespace, record: dict[str, Any], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib is not installed: no {path.name}; pip install -e 'examples[demo]')")
        return
    fig = loss_figure(args, record)
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path} and {path.with_name('demo_summary.json')}")


def loss_figure(args: argparse.Namespace, record: dict[str, Any]) -> Any:
    """The loss curves: train (every step) and validation, titled with the engine that ran."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=120)
    steps = range(1, len(record["losses"]) + 1)
    ax.plot(steps, record["losses"], lw=1, label=f"train (mean over {args.world} ranks)")
    if record["val"]:
        at, vals = zip(*record["val"], strict=True)
        ax.plot(at, vals, "o-", ms=3, label="validation")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # no fractional steps on short runs
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(
        f"{ENGINES[args.engine]}: {args.optimizer}, {args.world} ranks, {args.model} model",
        fontsize=10,
    )
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def parse(argv: list[str] | None = None, env: dict[str, str] | None = None) -> argparse.Namespace:
    """The command line; every bad value ends here with one argparse line and exit status 2."""
    env = dict(os.environ) if env is None else env
    p = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument(
        "--world-size",
        type=positive_int,
        default=None,
        help="ranks to spawn (default 2); under torchrun the world size is torchrun's",
    )
    p.add_argument("--steps", type=positive_int, default=300)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--mixed-precision", choices=("none", "bf16"), default="none")
    p.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="fsdp-engine",
        help="fsdp-engine (fsdp_engine.fully_shard) or fsdp2 (torch's, for comparison)",
    )
    p.add_argument("--batch-size", type=positive_int, default=16, help="sequences per rank/step")
    p.add_argument("--seq-len", type=non_negative_int, default=0, help="0: the model's context")
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=positive_int, default=25)
    p.add_argument("--sample", type=non_negative_int, default=80, help="characters to generate")
    p.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--timeout", type=positive_float, default=1800.0, help="seconds per run")
    p.add_argument("--out", default="runs/demo", help="folder for the PNG and the JSON summary")
    args = p.parse_args(argv)
    if args.steps < 2:
        p.error(f"argument --steps: must be at least 2, got {args.steps}")
    seq = args.seq_len or PRESETS[args.model].seq
    longest = len(load_corpus().val) - 2  # a window of seq + 1 tokens must fit the validation text
    if seq > longest:
        p.error(f"argument --seq-len: {seq} is longer than the validation text allows ({longest})")
    under_torchrun = "RANK" in env and "WORLD_SIZE" in env
    if under_torchrun:
        world = int(env["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != world:
            p.error(
                f"argument --world-size: {args.world_size} conflicts with torchrun's world size "
                f"{world} (set --nproc-per-node/--nnodes instead, or drop --world-size)"
            )
        args.world_size = world
    elif args.world_size is None:
        args.world_size = 2
    args.torchrun = under_torchrun
    return args


def _torchrun_main(args: argparse.Namespace) -> None:
    backend = "nccl" if torch.cuda.is_available() and args.device != "cpu" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout))
    try:
        args.world = dist.get_world_size()
        train(dist.get_rank(), args.world, args)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.torchrun:  # launched by torchrun: this process is one rank
        _torchrun_main(args)
        return
    from ragged_dtensor.testing import run_processes

    args.world = args.world_size
    args.device = "cpu"  # self-spawned ranks use gloo on this host; use torchrun for GPUs
    fn: Callable[..., Any] = train
    run_processes(fn, args.world, args, timeout=args.timeout)


if __name__ == "__main__":
    main()
