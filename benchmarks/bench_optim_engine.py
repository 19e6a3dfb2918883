"""Side by side: our engine + our optimizers vs torch FSDP2 + the optimizers users run today.

One run per world size (2 and 4, real gloo processes on this CPU), on the demo's ``medium`` model
(``examples/llama.py``: dim 256, 4 layers, FFN 768, 256 tokens, 2 sequences per rank). In each
process every side shards its own copy of the same model (same initial weights), takes the same
batches and the sides **alternate step by step** (who goes first rotates), so machine load hits
them alike.

Cases and sides:
- **Muon** (hidden matrices; embedding, head and norms on AdamW; lr, momentum 0.95, Nesterov, 5
  Newton-Schulz steps in bf16, ``adjust_lr_fn="original"``, decoupled weight decay, the same
  AdamW betas and eps on every side):
  - ours: ``fsdp_engine.fully_shard`` (per layer + root) + ``optim_blockwise.Muon``;
  - ``torch.optim.Muon`` on FSDP2 (+ ``torch.optim.AdamW``);
  - gather-to-all Muon on FSDP2 (Moonlight-style: every rank all-gathers every matrix in one
    batched bf16 all-gather and runs NS on all of them; ``bench_engine.GatherToAllMuon``).
- **AdamW8bit** (block 256): ours = our ``fully_shard`` with ``AdamW8bit.block_policy()`` +
  ``optim_blockwise.AdamW8bit``; peer = FSDP2 + ``torchao.optim.AdamW8bit`` (eager,
  ``TORCHDYNAMO_DISABLE=1``).

Per case, world size and side: forward+backward time and optimizer-step time (barriers before,
between and after; rank 0's clock; medians of the timed steps) and the optimizer step as a share
of forward+backward; paired ratios (median of ours_i / peer_i); on one untimed step after
warm-up: the transient memory of ``step()`` (``dbuffer.testing.LiveBytes``, a dispatch-mode tally of
live storages seeded with the parameters, gradients and state: peak minus start, per parameter
element of this rank), the ops dispatched by ``step()`` per parameter (every aten op, views
included), every collective at the dispatcher; the optimizer state per rank; the max |difference|
of the final parameters against the same optimizer on one process (global batch), and a control
where every rank trains on rank 0's batches (then the gradients are the one-device gradients up
to the rounding of their average: exact at world size 2).

    python benchmarks/bench_optim_engine.py [--out results] [--worlds 2 4] [--steps 10]
    python benchmarks/bench_optim_engine.py --from-json  # the table again from the JSON
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # torchao eager on CPU (before torch import)

import argparse
import contextlib
import json
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
from bench_engine import GatherToAllMuon, Optimizers  # one helper for both benchmarks
from demo import CollectiveTally
from llama import PRESETS, Corpus, get_batch, load_corpus, loss_fn, muon_param_groups
from llama import Llama as LlamaModel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
CFG = PRESETS["medium"]
BATCH = 2  # sequences per rank
SEED = 0
LR = 3e-3  # AdamW (and Muon's AdamW path)
MUON_LR = 0.02
WD = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8
MOMENTUM = 0.95
NS_STEPS = 5
BLOCK = 256

SIDES = {"Muon": ("ours", "torch", "gather"), "AdamW8bit": ("ours", "torchao")}
LABELS = {
    ("Muon", "ours"): "ours fully_shard + optim_blockwise.Muon",
    ("Muon", "torch"): "FSDP2 + torch.optim.Muon",
    ("Muon", "gather"): "FSDP2 + gather-to-all Muon",
    ("AdamW8bit", "ours"): "ours fully_shard + optim_blockwise.AdamW8bit",
    ("AdamW8bit", "torchao"): "FSDP2 + torchao.optim.AdamW8bit",
}


# -- optimizers ----------------------------------------------------------------------------------


def make_optimizer(case: str, side: str, model: nn.Module) -> Any:
    """The same hyper-parameters on every side; works on plain and on DTensor parameters."""
    import optim_blockwise as ob

    if case == "Muon":
        hidden, other = muon_param_groups(model)
        adamw = {"lr": LR, "betas": BETAS, "eps": EPS, "weight_decay": WD}
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
        if side == "torch":
            muon = torch.optim.Muon(
                hidden,
                lr=MUON_LR,
                weight_decay=WD,
                momentum=MOMENTUM,
                nesterov=True,
                ns_steps=NS_STEPS,
                adjust_lr_fn="original",
            )
            return Optimizers(muon, torch.optim.AdamW(other, **adamw))
        gather = GatherToAllMuon(
            hidden, lr=MUON_LR, weight_decay=WD, adjust_lr_fn="original", momentum=MOMENTUM
        )
        return Optimizers(gather, torch.optim.AdamW(other, **adamw))
    if side == "ours":
        return ob.AdamW8bit(
            model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, block_size=BLOCK
        )
    from torchao.optim import AdamW8bit

    return AdamW8bit(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, block_size=BLOCK
    )


def _opts(opt: Any) -> tuple[Any, ...]:
    return opt.opts if isinstance(opt, Optimizers) else (opt,)


def _plain_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding ``t``'s data (a DTensor's local tensor; a wrapper subclass such
    as torchao's 8-bit state by its inner tensors)."""
    if isinstance(t, DTensor):
        t = t.to_local()
    if type(t) not in (torch.Tensor, nn.Parameter) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [x for n in names for x in _plain_tensors(getattr(t, n))]
    return [t]


def _state_tensors(opt: Any) -> list[torch.Tensor]:
    out = []
    for o in _opts(opt):
        state = getattr(o, "state", {})
        if isinstance(state, dict) and "momentum" in state:  # GatherToAllMuon's buffers
            out += [b for b in state["momentum"]]
            continue
        for entry in state.values():
            for key, value in entry.items():
                if key != "step" and isinstance(value, torch.Tensor):
                    out += _plain_tensors(value)
    return out


def state_bytes(opt: Any) -> int:
    """Optimizer state held by this rank (``step`` counters excluded)."""
    return sum(t.numel() * t.element_size() for t in _state_tensors(opt))


def _subclass(types: Any) -> bool:
    """A tensor subclass (DTensor, torchao's 8-bit state) takes part: let it lower to plain
    tensors first, so the modes below see what really runs and what really gets allocated."""
    return any(t not in (torch.Tensor, nn.Parameter) for t in types)


class OpCount(TorchDispatchMode):
    """Every aten op on plain tensors (below DTensor and other subclasses), views included."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if _subclass(types):
            return NotImplemented
        self.count += 1
        return func(*args, **(kwargs or {}))


def _live_bytes(seed: list[torch.Tensor]) -> Any:
    """``dbuffer.testing.LiveBytes`` seeing plain-tensor allocations only (subclasses lowered
    first)."""
    from dbuffer.testing import LiveBytes

    class PlainLiveBytes(LiveBytes):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if _subclass(types):
                return NotImplemented
            return super().__torch_dispatch__(func, types, args, kwargs)

    return PlainLiveBytes(seed=seed)


# -- the sides -----------------------------------------------------------------------------------


@dataclass
class Runner:
    side: str
    model: nn.Module
    opt: Any
    fwd_bwd: list[float] = field(default_factory=list)
    opt_times: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def build(case: str, side: str, mesh: DeviceMesh, vocab: int) -> Runner:
    torch.manual_seed(SEED)  # the same initial weights on every rank, side and reference
    model = LlamaModel(CFG.with_vocab(vocab))
    if side == "ours":
        import fsdp_engine
        import optim_blockwise as ob

        policy: Any = ob.Muon.block_policy() if case == "Muon" else ob.AdamW8bit.block_policy(BLOCK)
        for layer in model.layers:
            fsdp_engine.fully_shard(layer, mesh=mesh, block_policy=policy)
        fsdp_engine.fully_shard(model, mesh=mesh, block_policy=policy)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return Runner(side, model, make_optimizer(case, side, model))


def batches(corpus: Corpus, rank: int, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + rank)
    return [get_batch(corpus.train, gen, BATCH, CFG.seq) for _ in range(n)]


def _timed(r: Runner, tokens: torch.Tensor) -> tuple[float, float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    loss = loss_fn(r.model, tokens)
    loss.backward()  # type: ignore[no-untyped-call]
    dist.barrier()
    t1 = time.perf_counter()
    r.opt.step()
    r.opt.zero_grad()
    dist.barrier()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, float(loss.detach())


def _measured(r: Runner, tokens: torch.Tensor) -> dict[str, Any]:
    """One untimed step: transient memory and ops of ``step()``, collectives of the step."""
    tally = CollectiveTally()
    with tally:
        loss = loss_fn(r.model, tokens)
        loss.backward()  # type: ignore[no-untyped-call]
        roots = [x for p in r.model.parameters() for x in _plain_tensors(p)]
        grads = [p.grad for p in r.model.parameters() if p.grad is not None]
        roots += [x for g in grads for x in _plain_tensors(g)]
        roots += _state_tensors(r.opt)
        count = OpCount()
        with _live_bytes(roots) as live, count:
            start = live.current
            r.opt.step()
        r.opt.zero_grad()
    local = sum(x.numel() for p in r.model.parameters() for x in _plain_tensors(p))
    return {
        "loss": float(loss.detach()),
        "transient_bytes": live.peak - start,
        "local_elements": local,
        "ops": count.count,
        "n_params": sum(1 for _ in r.model.parameters()),
        "collectives": dict(tally.calls),
        "collective_bytes": dict(tally.bytes),
    }


def worker(rank: int, world: int, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    corpus = load_corpus()
    data = batches(corpus, rank, warmup + steps)
    out: dict[str, Any] = {}
    for case, sides in SIDES.items():
        runners = [build(case, side, mesh, corpus.vocab) for side in sides]
        measured: dict[str, dict[str, Any]] = {}
        for i, tokens in enumerate(data):
            shift = i % len(runners)  # who goes first rotates
            for r in runners[shift:] + runners[:shift]:
                if i == warmup - 1:
                    measured[r.side] = _measured(r, tokens)
                    r.losses.append(measured[r.side]["loss"])
                    continue
                fwd_bwd, opt_time, loss = _timed(r, tokens)
                r.losses.append(loss)
                if i >= warmup:
                    r.fwd_bwd.append(fwd_bwd)
                    r.opt_times.append(opt_time)
        res: dict[str, Any] = {}
        for r in runners:
            full = {  # full_tensor() is a collective: every rank calls it, in the same order
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in r.model.named_parameters()
            }
            res[r.side] = {
                "fwd_bwd": r.fwd_bwd,
                "opt_times": r.opt_times,
                "losses": r.losses,
                "state_bytes": state_bytes(r.opt),
                "params": full if rank == 0 else None,
                **measured[r.side],
            }
        del runners
        # Control: every rank trains on rank 0's batches (gradients = one device's).
        same = batches(corpus, 0, warmup + steps)
        for side in sides:
            if side == "gather":
                continue  # no one-device counterpart
            r = build(case, side, mesh, corpus.vocab)
            for tokens in same:
                loss_fn(r.model, tokens).backward()  # type: ignore[no-untyped-call]
                r.opt.step()
                r.opt.zero_grad()
            full = {
                n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                for n, p in r.model.named_parameters()
            }
            res[side]["params_same_data"] = full if rank == 0 else None
        out[case] = res
    return out


# -- single-device references (parent process) ---------------------------------------------------


def reference(
    case: str, side: str, corpus: Corpus, ranks: list[int], n: int
) -> dict[str, torch.Tensor]:
    """The same optimizer class on one process, batch = these ranks' batches concatenated."""
    torch.manual_seed(SEED)
    model = LlamaModel(CFG.with_vocab(corpus.vocab))
    opt = make_optimizer(case, side, model)
    per_rank = [batches(corpus, r, n) for r in ranks]
    for i in range(n):
        loss = loss_fn(model, torch.cat([b[i] for b in per_rank]))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


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


def _paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def summarize(
    raw: dict[int, dict[str, Any]], diffs: dict[int, dict[str, dict[str, float | None]]]
) -> list[dict[str, Any]]:
    rows = []
    for world, res in raw.items():
        for case, sides in SIDES.items():
            ours = res[case]["ours"]
            for side in sides:
                e = res[case][side]
                fwd = statistics.median(e["fwd_bwd"])
                opt = statistics.median(e["opt_times"])
                total = [a + b for a, b in zip(e["fwd_bwd"], e["opt_times"], strict=True)]
                ours_total = [
                    a + b for a, b in zip(ours["fwd_bwd"], ours["opt_times"], strict=True)
                ]
                row: dict[str, Any] = {
                    "case": case,
                    "world": world,
                    "side": side,
                    "label": LABELS[(case, side)],
                    "fwd_bwd_ms": 1e3 * fwd,
                    "opt_ms": 1e3 * opt,
                    "opt_share": opt / fwd,
                    "step_ms": 1e3 * statistics.median(total),
                    "transient_per_element": e["transient_bytes"] / max(e["local_elements"], 1),
                    "transient_mib": e["transient_bytes"] / 2**20,
                    "ops_per_param": e["ops"] / max(e["n_params"], 1),
                    "collectives": sum(e["collectives"].values()),
                    "collective_kinds": e["collectives"],
                    "collective_mib": sum(e["collective_bytes"].values()) / 2**20,
                    "state_bytes_per_element": e["state_bytes"] / max(e["local_elements"], 1),
                    "state_mib": e["state_bytes"] / 2**20,
                    "max_abs_diff_vs_1dev": diffs[world][case][side],
                    "max_abs_diff_vs_1dev_same_data": diffs[world][case].get(side + "-same"),
                    "final_loss": e["losses"][-1],
                }
                if side != "ours":
                    row["ours_step_over_this"] = _paired(ours_total, total)
                    row["ours_opt_over_this"] = _paired(ours["opt_times"], e["opt_times"])
                    row["ours_state_over_this"] = ours["state_bytes"] / max(e["state_bytes"], 1)
                rows.append(row)
    return rows


def _kinds(calls: dict[str, int]) -> str:
    return " ".join(f"{v} {k}" for k, v in sorted(calls.items()))


def _num(x: float | None, fmt: str, suffix: str = "") -> str:
    return "-" if x is None else format(x, fmt) + suffix


def markdown(rows: list[dict[str, Any]], info: dict[str, str], args: argparse.Namespace) -> str:
    out = [
        "# Our engine + optimizers vs FSDP2 + torch.optim.Muon / gather-to-all Muon / torchao",
        "",
        f"{info['date']}, {info['nproc']} x {info['cpu']} (load average at the end "
        f"{info['load']}), torch {info['torch']}, torchao {info['torchao']}, Python "
        f"{info['python']}, commit {info['commit']}. gloo processes, 1 thread each; the demo's "
        f"medium model (dim {CFG.dim}, {CFG.layers} layers, FFN {CFG.ffn}, {CFG.seq} tokens, "
        f"{BATCH} sequences per rank); {args.warmup} warm-up + {args.steps} timed steps, the "
        "sides alternating step by step in the same processes. "
        "`python benchmarks/bench_optim_engine.py`.",
        "",
        "| case | world | side | fwd+bwd ms | opt step ms | opt / fwd+bwd | step: ours / this "
        "| opt: ours / this | step() transient B/elem | step() ops/param | collectives/step "
        "| state B/elem | state: ours / this | max abs diff vs 1 device | same, identical "
        "batches |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['case']} | {r['world']} | {r['label']} | {r['fwd_bwd_ms']:.0f} | "
            f"{r['opt_ms']:.1f} | {100 * r['opt_share']:.1f}% | "
            f"{_num(r.get('ours_step_over_this'), '.2f', 'x')} | "
            f"{_num(r.get('ours_opt_over_this'), '.3f', 'x')} | "
            f"{r['transient_per_element']:.2f} | {r['ops_per_param']:.0f} | "
            f"{r['collectives']} ({_kinds(r['collective_kinds'])}) | "
            f"{r['state_bytes_per_element']:.2f} | "
            f"{_num(r.get('ours_state_over_this'), '.2f', 'x')} | "
            f"{_num(r['max_abs_diff_vs_1dev'], '.2e')} | "
            f"{_num(r['max_abs_diff_vs_1dev_same_data'], '.2e')} |"
        )
    out += [
        "",
        "- fwd+bwd and opt step: medians over the timed steps (barriers before, between and "
        "after; rank 0's clock); opt step includes `zero_grad`. Ratios ours / this: median of "
        "the paired per-step ratios (the sides' steps are adjacent in time).",
        "- step() transient: peak live storage during `optimizer.step()` beyond what existed "
        "before it (`dbuffer.testing.LiveBytes`, seeded with parameters, gradients and state), per "
        "parameter element of rank 0; ops/param: aten ops `step()` dispatched below DTensor, "
        "views included, per parameter.",
        "- collectives/step: every `c10d`/`_c10d_functional` op at the dispatcher on one "
        "untimed step (forward, backward and optimizer; it sees DTensor's functional "
        "collectives inside `torch.optim.Muon`).",
        "- max abs diff: final parameters vs the same optimizer class on one process with every "
        "rank's batch concatenated; nonzero values are the rounding of a different gradient "
        "reduction order, amplified by training. The control (last column) trains every rank "
        "on rank 0's batches: the gradients are the one-device gradients up to the rounding of "
        "their average (exact at world size 2). No one-device counterpart for gather-to-all.",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    from ragged_dtensor.testing import run_processes

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(ROOT / "results"))
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps (the last is measured)")
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--from-json",
        action="store_true",
        help="rewrite bench_optim_engine.md in --out from its bench_optim_engine.json (no run)",
    )
    args = p.parse_args(argv)
    if args.from_json:
        payload = json.loads((Path(args.out) / "bench_optim_engine.json").read_text())
        saved = argparse.Namespace(**payload["args"])
        table = markdown(payload["rows"], payload["machine"], saved)
        (Path(args.out) / "bench_optim_engine.md").write_text(table)
        print(table)
        return
    torch.set_num_threads(1)
    corpus = load_corpus()
    n = args.warmup + args.steps
    raw: dict[int, dict[str, Any]] = {}
    diffs: dict[int, dict[str, dict[str, float | None]]] = {}
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
        diffs[world] = {}
        for case, sides in SIDES.items():
            d: dict[str, float | None] = {}
            for side in sides:
                got = res[case][side].pop("params")
                same = res[case][side].pop("params_same_data", None)
                if side == "gather":
                    d[side] = d[side + "-same"] = None
                    continue
                d[side] = max_diff(got, reference(case, side, corpus, list(range(world)), n))
                assert same is not None
                d[side + "-same"] = max_diff(same, reference(case, side, corpus, [0], n))
            diffs[world][case] = d
        raw[world] = res
        print(f"world {world}: {time.perf_counter() - start:.0f} s", flush=True)
    rows = summarize(raw, diffs)
    info = machine()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(rows, info, args)
    (out / "bench_optim_engine.md").write_text(table)
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
        "raw": raw,
    }
    (out / "bench_optim_engine.json").write_text(json.dumps(payload, indent=1))
    print(table)


if __name__ == "__main__":
    main()
