"""Serializing one sharded parameter: bytes written and memory copied, ours vs torch FSDP2.

People save, pickle and deep-copy single parameters (EMA weights, logging, debugging). FSDP2's
sharded parameter owns a storage of its own elements (plus its padding); ours views one flat
storage per group. This measures, for single parameters of a model sharded at the root (one
group: its shard on this rank is ``--blocks`` x (Linear(d, d) + LayerNorm(d)) / world):

- ``torch.save`` bytes (into memory) and ``pickle.dumps`` bytes of the parameter, its
  ``to_local()`` (with grad mode on, as a training loop calls it), its ``.grad`` and the
  ``.grad``'s ``to_local()``;
- ``copy.deepcopy`` of the parameter, before the backward and with its ``.grad``: the bytes of
  the storages the copy holds (its local tensor and its gradient's; deterministic);
- the rank's ``elements`` of the parameter (ours places whole tensors on a rank where FSDP2
  splits each in ``Shard(0)``: one rank's bytes differ by layout, their sum over ranks does not);
- whole-state-dict saves must keep their speed: ``torch.save(model.state_dict())`` (into
  memory), ``dcp.save`` and DCP's stager copy (``_create_cpu_state_dict`` + ``_copy_state_dict``),
  median of ``--repeats`` (rank 0's clock between barriers);
- twelve ``copy.deepcopy`` of single parameters (LayerNorm weights and biases, Linear weights and
  biases, round robin) kept alive: the process's resident-memory growth (``/proc/self/statm``,
  malloc's mmap threshold pinned so that freed memory is not reused silently), and the
  storage bytes they hold.

Each engine runs in a fresh process of its own (``--engine``) on torch's threaded process group
(``--world`` ranks in one process, each rank measures in turn while the others wait at a
barrier; the table sums the ranks' figures: every rank saves or copies its share), with the
same model, weights and batch: the copies of parameters without ``.grad`` first, then one
forward/backward and the rest. Where torch itself fails (FSDP2's ``.grad`` views its
reduce-scatter output at an offset, which vanilla torch cannot save or copy), the table says so.

    python benchmarks/bench_serialize_param.py                 # both engines, ~1 minute
    python benchmarks/bench_serialize_param.py --json out.json
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from ragged_dtensor.testing import run_threaded

ENGINES = ("fsdp2", "ours")
OBJECTS = ("param", "to_local()", ".grad", ".grad.to_local()")


def _model(blocks: int, dim: int) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(dim, dim), nn.LayerNorm(dim)]
    return nn.Sequential(*layers)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _storages(value: Any) -> int:
    """Bytes of the distinct storages ``value`` (a tensor, DTensor) holds, its grad's too."""
    seen: dict[tuple[str, int], int] = {}

    def visit(t: torch.Tensor | None) -> None:
        if t is None:
            return
        if isinstance(t, DTensor):
            visit(t._local_tensor)
            visit(t.grad)
            return
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()
        visit(t.grad)

    visit(value)
    return sum(seen.values())


def _saved(value: Any) -> int:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return len(buffer.getvalue())


def _attempt(measure: Any) -> int | str:
    """The figure, or the error torch raised (FSDP2's ``.grad`` views its reduce-scatter output
    at an offset: vanilla torch cannot save it)."""
    try:
        return int(measure())
    except RuntimeError as exc:
        return f"fails: {str(exc).splitlines()[0][:60]}"


def _objects(param: DTensor) -> dict[str, torch.Tensor]:
    grad = param.grad
    assert isinstance(grad, DTensor)
    with torch.enable_grad():
        return {
            "param": param,
            "to_local()": param.to_local(),
            ".grad": grad,
            ".grad.to_local()": grad.to_local(),
        }


def _body(
    rank: int, world: int, engine: str, blocks: int, dim: int, root: str, repeats: int
) -> dict[str, Any]:
    if engine == "ours":
        from fsdp_engine import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,))
    model = _model(blocks, dim)
    fully_shard(model, mesh=mesh)
    out: dict[str, Any] = {}
    params = dict(model.named_parameters())
    picks = {"LayerNorm weight": "1.weight", "Linear weight": "0.weight"}
    for turn in range(world):  # copies before any backward: parameters without .grad
        if rank != turn:
            dist.barrier()
            continue
        for label, name in picks.items():
            out[label] = {"elements": params[name].to_local().numel()}
            out[label]["deepcopy storage bytes"] = _attempt(
                lambda p=params[name]: _storages(copy.deepcopy(p))
            )
        names = [n for n in params if n.endswith(("weight", "bias"))]
        chosen = [names[(i * 7) % len(names)] for i in range(12)]
        before = _rss()
        copies = [copy.deepcopy(params[n]) for n in chosen]
        grown = _rss() - before
        out["12 deepcopies"] = {
            "rss growth bytes": grown,
            "storage bytes": sum(_storages(c) for c in copies),
            "own elements bytes": sum(
                params[n].to_local().numel() * params[n].element_size() for n in chosen
            ),
        }
        del copies
        dist.barrier()
    torch.manual_seed(1)
    model(torch.randn(4, dim)).sum().backward()
    for turn in range(world):
        if rank != turn:
            dist.barrier()
            continue
        for label, name in picks.items():
            param = params[name]
            assert isinstance(param, DTensor)
            row = out[label]
            for what, value in _objects(param).items():
                row[f"torch.save {what}"] = _attempt(lambda v=value: _saved(v))
                row[f"pickle {what}"] = _attempt(lambda v=value: len(pickle.dumps(v)))
            row["deepcopy with .grad storage bytes"] = _attempt(
                lambda p=param: _storages(copy.deepcopy(p))
            )
        dist.barrier()
    out["saves"] = _save_times(model, rank, engine, root, repeats)
    return out


def _save_times(
    model: nn.Module, rank: int, engine: str, root: str, repeats: int
) -> dict[str, Any]:
    """Median seconds (rank 0's clock, between barriers) of whole-state-dict saves: they must
    keep their speed (a state dict's tensors, views of one storage or not)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

    def whole_torch_save() -> int:
        return _saved(model.state_dict())

    def dcp_save() -> int:
        dcp.save(model.state_dict(), checkpoint_id=f"{root}/{engine}-{time.monotonic_ns()}")
        return 0

    def staged_copy() -> int:
        sd = model.state_dict()
        _copy_state_dict(sd, _create_cpu_state_dict(sd))
        return 0

    out: dict[str, Any] = {}
    for name, fn in (
        ("torch.save(state_dict())", whole_torch_save),
        ("dcp.save", dcp_save),
        ("_copy_state_dict (DCP's stager)", staged_copy),
    ):
        times, written = [], 0
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            written = fn()
            dist.barrier()
            times.append(time.perf_counter() - start)
        out[name] = {"median s": statistics.median(times), "bytes": written}
    return out


def _one(engine: str, world: int, blocks: int, dim: int, repeats: int) -> dict[str, Any]:
    """Every figure summed over the ranks (each rank saves / copies its own share), and rank
    0's alone; an error on any rank is the figure. Save times: rank 0's clock."""
    with tempfile.TemporaryDirectory() as root:
        ranks: list[dict[str, Any]] = run_threaded(
            _body, world, engine, blocks, dim, root, repeats, timeout=900
        )
    saves = ranks[0].pop("saves")
    for r in ranks[1:]:
        r.pop("saves")

    def total(path: tuple[str, str]) -> int | str:
        values = [r[path[0]][path[1]] for r in ranks]
        failed = [v for v in values if not isinstance(v, int)]
        return failed[0] if failed else sum(values)

    return {
        "sum over ranks": {
            group: {key: total((group, key)) for key in ranks[0][group]} for group in ranks[0]
        },
        "rank 0": ranks[0],
        "saves": saves,
    }


def _n(value: int | str) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)


def _ratio(a: int | str, b: int | str) -> str:
    return f"{a / b:.2f}" if isinstance(a, int) and isinstance(b, int) else "-"


def _table(results: dict[str, dict[str, Any]]) -> str:
    lines = [
        "| parameter | object | ours torch.save | FSDP2 torch.save | ratio | ours pickle "
        "| FSDP2 pickle | ratio |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ours, fsdp2 = results["ours"]["sum over ranks"], results["fsdp2"]["sum over ranks"]
    for label in ("LayerNorm weight", "Linear weight"):
        for what in OBJECTS:
            a, b = ours[label][f"torch.save {what}"], fsdp2[label][f"torch.save {what}"]
            c, d = ours[label][f"pickle {what}"], fsdp2[label][f"pickle {what}"]
            lines.append(
                f"| {label} | `{what}` | {_n(a)} | {_n(b)} | {_ratio(a, b)} | {_n(c)} | {_n(d)} "
                f"| {_ratio(c, d)} |"
            )
    lines.append("")
    lines.append("| copy | ours | FSDP2 |")
    lines.append("|---|---|---|")
    for label in ("LayerNorm weight", "Linear weight"):
        for key, when in (
            ("deepcopy storage bytes", "before backward"),
            ("deepcopy with .grad storage bytes", "with its .grad"),
        ):
            lines.append(
                f"| `deepcopy` {label} ({when}): storage bytes | {_n(ours[label][key])} "
                f"| {_n(fsdp2[label][key])} |"
            )
    mib = 1 << 20
    for key, name in (("rss growth bytes", "RSS growth"), ("storage bytes", "storage bytes")):
        lines.append(
            f"| 12 `deepcopy`s: {name} | {ours['12 deepcopies'][key] / mib:.1f} MiB | "
            f"{fsdp2['12 deepcopies'][key] / mib:.1f} MiB |"
        )
    lines += ["", "| whole state dict, median of saves (rank 0) | ours | FSDP2 |", "|---|---|---|"]
    for name in results["ours"]["saves"]:
        a, b = results["ours"]["saves"][name], results["fsdp2"]["saves"][name]
        size = f" ({a['bytes']:,} / {b['bytes']:,} bytes)" if a["bytes"] else ""
        lines.append(
            f"| `{name}`{size} | {a['median s'] * 1e3:.1f} ms | {b['median s'] * 1e3:.1f} ms |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES, help="run one engine here (internal)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5, help="timed whole-state-dict saves")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.engine:
        print(json.dumps(_one(args.engine, args.world, args.blocks, args.dim, args.repeats)))
        return
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS="1")
    results = {}
    for engine in ENGINES:
        cmd = [
            sys.executable,
            __file__,
            "--engine",
            engine,
            "--world",
            str(args.world),
            "--blocks",
            str(args.blocks),
            "--dim",
            str(args.dim),
            "--repeats",
            str(args.repeats),
        ]
        done = subprocess.run(
            cmd, check=False, env=env, capture_output=True, text=True, timeout=900
        )
        if done.returncode != 0:
            raise SystemExit(f"{engine} failed:\n{done.stderr[-4000:]}")
        results[engine] = json.loads(done.stdout.strip().splitlines()[-1])
    shard = args.blocks * (args.dim * args.dim + 3 * args.dim) * 4 // args.world
    print(
        f"world {args.world}, one group, its shard on each rank about {shard:,} bytes; "
        "figures summed over the ranks\n"
    )
    print(_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"world": args.world, "blocks": args.blocks, "dim": args.dim, "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
