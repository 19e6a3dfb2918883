"""What the reliability features cost, measured side by side in one run.

1. Checkpoint integrity: ``save_checkpoint`` / ``load_checkpoint`` of the demo medium model
   (``examples/llama.py`` "medium", AdamW state included) at world size 2, with the digests
   (hashing every byte written; verifying every byte read) and without (``verify=False`` on
   load; on save the same code path with the hashing stubbed out), alternating, medians.
2. Collective debug mode: the training step of the demo model (``--debug-model``, default the
   demo's "tiny") at world sizes 2 and 4, in processes started without and with
   ``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1`` (read when the engine's first RaggedShard installs the
   DTensor integration), alternating runs; medians of the
   timed steps, and the collectives each step issues (the same in both: the checks go through
   the store).

    python benchmarks/bench_reliability.py --out results     # ~15 minutes on 2 cores

Writes ``bench_reliability.md`` and ``bench_reliability.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import torch
import torch.distributed as dist


def _model(name: str, world: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from demo import build
    from llama import load_corpus
    from torch.distributed.device_mesh import init_device_mesh

    args = argparse.Namespace(
        model=name, seq_len=0, seed=0, engine="ours", optimizer="adamw", mixed_precision="none",
        lr=3e-3,
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (world,))
    return build(args, load_corpus(), mesh, torch.device("cpu"))


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    from llama import get_batch, load_corpus, loss_fn

    corpus = load_corpus()
    gen = torch.Generator().manual_seed(1_000_003 * step + rank)
    tokens = get_batch(corpus.train, gen, 16, model.cfg.seq)  # type: ignore[union-attr]
    loss_fn(model, tokens).backward()
    opt.step()
    opt.zero_grad()


# -- 1. checkpoint integrity ----------------------------------------------------------------------


def _integrity(rank: int, world: int, root: str, rounds: int) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import fsdp_engine._private.checkpoint_files as files
    from fsdp_engine import checkpoint_info, load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    model, opt = _model("medium", world)
    _step(model, opt, 0, rank)
    real_record = files.file_record

    def no_hashing(path: Path, *args: Any) -> dict[str, Any]:
        return {"size": path.stat().st_size, "items": [], "digest": ""}

    kinds = ("crc32", "sha256", "none")
    times: dict[str, list[float]] = {f"save {k}": [] for k in kinds}
    times.update({f"load {k}": [] for k in kinds})
    cpu: dict[str, list[float]] = {key: [] for key in times}
    saved: dict[str, list[Path]] = {"crc32": [], "sha256": []}
    for index in range(rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            files.file_record = no_hashing if kind == "none" else real_record  # type: ignore[assignment]
            model_sd, optim_sd = get_state_dict(model, opt)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            path = save_checkpoint(
                {"model": model_sd, "optim": optim_sd},
                Path(root) / f"r{index}{kind}",
                digest="crc32" if kind == "none" else kind,
            )
            cpu[f"save {kind}"].append(time.process_time() - c0)
            dist.barrier()
            times[f"save {kind}"].append(time.perf_counter() - t0)
            if kind != "none":
                saved[kind].append(path)
    files.file_record = real_record  # type: ignore[assignment]
    for index in range(rounds):
        for kind in kinds if index % 2 == 0 else kinds[::-1]:
            path = saved["crc32" if kind == "none" else kind][index]
            model_sd, optim_sd = get_state_dict(model, opt)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            load_checkpoint({"model": model_sd, "optim": optim_sd}, path, verify=kind != "none")
            cpu[f"load {kind}"].append(time.process_time() - c0)
            dist.barrier()
            times[f"load {kind}"].append(time.perf_counter() - t0)
    info = checkpoint_info(saved["crc32"][0])
    size = sum(record["size"] for record in info["files"].values())
    return {"times": times, "cpu": cpu, "bytes": size, "files": len(info["files"])}


# -- 2. debug mode ---------------------------------------------------------------------------------


def _debug_steps(rank: int, world: int, model_name: str, steps: int) -> dict[str, Any]:
    import ragged_dtensor
    from ragged_dtensor.testing import count_collectives

    torch.set_num_threads(1)
    model, opt = _model(model_name, world)
    times = []
    cpu = []
    calls: dict[str, int] = {}
    for step in range(steps + 3):
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        if step == 2:
            with count_collectives() as counter:
                _step(model, opt, step, rank)
            calls = dict(counter.calls)
        else:
            _step(model, opt, step, rank)
        spent = time.process_time() - c0
        dist.barrier()
        if step >= 3:
            times.append(time.perf_counter() - t0)
            cpu.append(spent)
    enabled = ragged_dtensor.collective_checks_enabled()
    return {"times": times, "cpu": cpu, "calls": calls, "checks": enabled}


def _spawn_debug(world: int, model: str, steps: int, debug: bool) -> dict[str, Any]:
    """One run in fresh processes (the debug mode is decided by the environment when the DTensor
    integration is installed)."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks');"
        "from bench_reliability import _debug_steps;"
        "from ragged_dtensor.testing import run_processes;"
        f"out = run_processes(_debug_steps, {world}, {model!r}, {steps}, timeout=1800);"
        "print('RESULT', json.dumps(out[0]))"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RAGGED_DTENSOR_DEBUG_COLLECTIVES", None)
    if debug:
        env["RAGGED_DTENSOR_DEBUG_COLLECTIVES"] = "1"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, check=False
    )
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    raise SystemExit(f"debug run failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


# -- report ------------------------------------------------------------------------------------


def main() -> None:
    from ragged_dtensor.testing import run_processes

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="results")
    parser.add_argument("--rounds", type=int, default=6, help="saves/loads of each kind")
    parser.add_argument("--debug-model", default="tiny")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per debug run")
    parser.add_argument("--runs", type=int, default=2, help="runs of each debug mode")
    parser.add_argument("--skip", choices=("integrity", "debug"), default=None)
    args = parser.parse_args()
    results: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": _cpu(),
        "torch": torch.__version__,
    }
    if args.skip != "integrity":
        with tempfile.TemporaryDirectory() as root:
            out = run_processes(_integrity, 2, root, args.rounds, timeout=3600)
        times = out[0]["times"]  # rank 0's clock, between barriers
        med = {k: statistics.median(v) for k, v in times.items()}
        cpu_med = {k: statistics.median(v) for k, v in out[0]["cpu"].items()}
        results["integrity"] = {
            "times": times,
            "cpu": out[0]["cpu"],
            "median": med,
            "cpu_median": cpu_med,
            "cpu_overhead": {
                f"{op} {kind}": cpu_med[f"{op} {kind}"] / cpu_med[f"{op} none"] - 1
                for op in ("save", "load")
                for kind in ("crc32", "sha256")
            },
            "checkpoint_bytes": out[0]["bytes"],
            "files": out[0]["files"],
            "overhead": {
                f"{op} {kind}": med[f"{op} {kind}"] / med[f"{op} none"] - 1
                for op in ("save", "load")
                for kind in ("crc32", "sha256")
            },
        }
    if args.skip != "debug":
        results["debug"] = {}
        for world in (2, 4):
            runs: dict[str, list[float]] = {"off": [], "on": []}
            cpus: dict[str, list[float]] = {"off": [], "on": []}
            calls: dict[str, dict[str, int]] = {}
            for index in range(args.runs):
                for debug in (False, True) if index % 2 == 0 else (True, False):
                    got = _spawn_debug(world, args.debug_model, args.steps, debug)
                    assert got["checks"] is debug
                    runs["on" if debug else "off"] += got["times"]
                    cpus["on" if debug else "off"] += got["cpu"]
                    calls["on" if debug else "off"] = got["calls"]
            off, on = statistics.median(runs["off"]), statistics.median(runs["on"])
            cpu_off, cpu_on = statistics.median(cpus["off"]), statistics.median(cpus["on"])
            results["debug"][str(world)] = {
                "step_s_off": off,
                "step_s_on": on,
                "overhead": on / off - 1,
                "cpu_s_off": cpu_off,
                "cpu_s_on": cpu_on,
                "cpu_overhead": cpu_on / cpu_off - 1,
                "cpu": cpus,
                "collectives_off": calls["off"],
                "collectives_on": calls["on"],
                "times": runs,
            }
    results["load"] = os.getloadavg()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench_reliability.json").write_text(json.dumps(results, indent=1))
    text = _markdown(results, args)
    (out_dir / "bench_reliability.md").write_text(text)
    print(text)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} cores"
    except OSError:
        pass
    return f"{os.cpu_count()} cores"


def _markdown(r: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"# Reliability costs ({r['when']}; {r['cpu']}; torch {r['torch']}; gloo; load at the "
        f"end {' '.join(f'{x:.2f}' for x in r['load'])})",
        "",
        "`python benchmarks/bench_reliability.py`; wall: rank 0's clock between barriers; CPU: "
        "rank 0's process time (on an oversubscribed machine the wall clock mostly measures "
        "waiting for a core, the CPU time what the feature costs); medians.",
        "",
    ]
    if "integrity" in r:
        i = r["integrity"]
        m = i["median"]
        lines += [
            f"Checkpoint integrity, demo medium model + AdamW state, world size 2, "
            f"{i['checkpoint_bytes'] / 2**20:.1f} MiB in {i['files']} files, {args.rounds} of "
            f"each kind alternating:",
            "",
            "| | CRC-32 digests (default) | SHA-256 digests | no digests | cost CRC-32 | "
            "cost SHA-256 |",
            "|---|---|---|---|---|---|",
        ]
        c = i["cpu_median"]
        for op, plain in (("save", "hashing stubbed out"), ("load", "verify=False")):
            lines.append(
                f"| {op}_checkpoint, wall | {m[f'{op} crc32']:.3f} s | {m[f'{op} sha256']:.3f} s "
                f"| {m[f'{op} none']:.3f} s ({plain}) | "
                f"{100 * i['overhead'][f'{op} crc32']:+.1f}% | "
                f"{100 * i['overhead'][f'{op} sha256']:+.1f}% |"
            )
            lines.append(
                f"| {op}_checkpoint, CPU of rank 0 | {c[f'{op} crc32']:.3f} s | "
                f"{c[f'{op} sha256']:.3f} s | {c[f'{op} none']:.3f} s | "
                f"{100 * i['cpu_overhead'][f'{op} crc32']:+.1f}% | "
                f"{100 * i['cpu_overhead'][f'{op} sha256']:+.1f}% |"
            )
        lines.append("")
    if "debug" in r:
        lines += [
            f"Collective debug mode (`RAGGED_DTENSOR_DEBUG_COLLECTIVES=1`), demo model "
            f"({args.debug_model}) + AdamW, {args.runs} runs of {args.steps} timed steps per "
            f"mode, alternating:",
            "",
            "| world | step, default | step, debug mode | overhead | CPU per step and rank, "
            "default / debug | CPU overhead | collectives per step (default = debug) |",
            "|---|---|---|---|---|---|---|",
        ]
        for world, d in r["debug"].items():
            same = d["collectives_off"] == d["collectives_on"]
            count = sum(d["collectives_off"].values())
            lines.append(
                f"| {world} | {d['step_s_off']:.3f} s | {d['step_s_on']:.3f} s | "
                f"{100 * d['overhead']:+.1f}% | {d['cpu_s_off']:.3f} / {d['cpu_s_on']:.3f} s | "
                f"{100 * d['cpu_overhead']:+.1f}% | {count} "
                f"({'same' if same else 'DIFFERENT'}) |"
            )
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
