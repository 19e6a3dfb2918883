"""``shard-planner``: the scale report, projections, the mesh advisor, plots, one-off plans.

shard-planner report --model gpt-oss-120b --world 64,256 --block-rows 1,16,128,32x32
shard-planner project --model gpt-oss-120b --world 128,256 --gpu H800 --reduce-dtype bf16
shard-planner advise --model llama3-70b --world 16384 --gpu H100 --block-rows 16 \
    --activation-checkpointing
shard-planner plot --out plots/                          # needs shard-planner[plot]
shard-planner plan specs.json --world 8 --align 8        # [{"numel":..,"block":..,"name":..}]
shard-planner models
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs

from shard_planner import METHODS, TensorSpec, lower_bound, plan
from shard_planner.projection._private.advise import advise
from shard_planner.projection._private.catalogue import MODELS, catalogue_model
from shard_planner.projection._private.hardware import GPUS, NETWORKS
from shard_planner.projection._private.project import OPTIMIZERS, Projection, Setup, project
from shard_planner.projection._private.report import (
    format_json,
    format_table,
    parse_granularity,
    report_rows,
)

__all__ = ["main"]

DEFAULT_WORLDS = "8,16,32,64,128,256,512,1024,2048,4096,8192,16384"
DEFAULT_GRANULARITIES = "1,16,128,32x32,128x128"


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{what}: expected comma-separated integers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError(f"{what}: empty list")
    return values


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shard-planner",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("report", help="padding of ours vs baselines vs the lower bound")
    rep.add_argument(
        "--model",
        action="append",
        choices=MODELS,
        help="catalogue model (repeatable; default: all)",
    )
    rep.add_argument("--world", default=DEFAULT_WORLDS, help="comma-separated world sizes")
    rep.add_argument(
        "--block-rows",
        default=DEFAULT_GRANULARITIES,
        help="comma-separated granularities: rows (16) or tiles (32x32)",
    )
    rep.add_argument("--itemsize", type=int, default=2, help="bytes per element (bf16: 2)")
    rep.add_argument(
        "--align-bytes",
        type=int,
        default=16,
        help="shard sizes are multiples of this many bytes (NCCL: 16)",
    )
    rep.add_argument("--format", choices=("table", "json"), default="table")
    one = sub.add_parser("plan", help="plan one group given as JSON")
    one.add_argument(
        "specs", help='JSON file ("-" for stdin): [{"numel": n, "block": g, "name": s}, ...]'
    )
    one.add_argument("--world", type=int, required=True)
    one.add_argument("--align", type=int, default=1)
    one.add_argument("--method", choices=METHODS, default="auto")
    sub.add_parser("models", help="list the catalogue's models and groups")
    proj = sub.add_parser(
        "project", help="per-rank peak memory and step time, ours vs FSDP2, per world size"
    )
    _model_arg(proj, many=True)
    proj.add_argument("--world", default=DEFAULT_WORLDS, help="comma-separated world sizes")
    proj.add_argument(
        "--shard-ranks",
        type=int,
        help="shard-group size (HSDP: world / shard-ranks replicas; default: the world size)",
    )
    proj.add_argument("--layers-per-group", type=int, default=1)
    proj.add_argument(
        "--merge-ends",
        action="store_true",
        help="embedding and head share the first and last layer groups",
    )
    _setup_args(proj)
    proj.add_argument("--format", choices=("table", "json"), default="table")
    adv = sub.add_parser(
        "advise", help="the shard-group size (HSDP) and layer grouping to use, and why"
    )
    _model_arg(adv, many=False)
    adv.add_argument("--world", type=int, required=True)
    adv.add_argument("--max-padding", type=float, default=1.0, help="percent (default 1)")
    adv.add_argument("--budget-gb", type=float, help="memory per GPU (default: usable HBM)")
    _setup_args(adv)
    plot = sub.add_parser("plot", help="PNG plots: padding and peak memory vs m, ours vs FSDP2")
    _model_arg(plot, many=True)
    plot.add_argument("--world", default=DEFAULT_WORLDS, help="comma-separated world sizes")
    plot.add_argument("--out", required=True, help="folder for the PNG files")
    _setup_args(plot)
    return parser


_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _model_arg(parser: argparse.ArgumentParser, *, many: bool) -> None:
    if many:
        parser.add_argument(
            "--model", action="append", choices=MODELS, help="repeatable; default: all"
        )
    else:
        parser.add_argument("--model", choices=MODELS, required=True)


def _setup_args(parser: argparse.ArgumentParser) -> None:
    """The run's assumptions (``Setup``): every default is stated in ``--help``."""
    d = Setup()
    parser.add_argument("--gpu", choices=sorted(GPUS), default="H100")
    parser.add_argument("--network", choices=sorted(NETWORKS), default=d.network)
    parser.add_argument("--seq", type=int, default=d.seq, help=f"tokens per sequence ({d.seq})")
    parser.add_argument(
        "--micro-batch", type=int, default=d.micro_batch, help="sequences per rank per step"
    )
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument(
        "--param-dtype",
        choices=sorted(_DTYPES),
        default="fp32",
        help="parameter shards and sharded gradients (fp32)",
    )
    parser.add_argument(
        "--compute-dtype",
        choices=sorted(_DTYPES),
        default="bf16",
        help="gathered parameters, activations, unsharded gradients (bf16)",
    )
    parser.add_argument(
        "--reduce-dtype", choices=sorted(_DTYPES), default="fp32", help="gradient reduction (fp32)"
    )
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default=d.optimizer)
    parser.add_argument("--mfu", type=float, default=d.mfu, help=f"assumed MFU ({d.mfu})")
    parser.add_argument(
        "--prefetch",
        type=int,
        default=d.forward_prefetch,
        help="groups all-gathered ahead in forward and backward (1)",
    )
    parser.add_argument(
        "--block-rows",
        default="0",
        help="our planner's blocks: rows (16) or tiles (128x128); 0: no structure (default)",
    )


def _setup(args: argparse.Namespace) -> Setup:
    gran = parse_granularity(args.block_rows) if args.block_rows.strip() != "0" else None
    return Setup(
        seq=args.seq,
        micro_batch=args.micro_batch,
        activation_checkpointing=args.activation_checkpointing,
        param_bytes=_DTYPES[args.param_dtype],
        compute_bytes=_DTYPES[args.compute_dtype],
        reduce_bytes=_DTYPES[args.reduce_dtype],
        optimizer=args.optimizer,
        mfu=args.mfu,
        forward_prefetch=args.prefetch,
        backward_prefetch=args.prefetch,
        block_rows=0 if gran is None else gran.rows,
        tile=False if gran is None else gran.tile,
        network=args.network,
    )


def _gb(value: float) -> str:
    return f"{value / 1e9:.1f}"


def _projection_rows(projections: Sequence[Projection]) -> str:
    head = (
        "| model | m | mesh | ours GB | FSDP2 GB | usable GB | fits ours / FSDP2 | ours s/step "
        "| FSDP2 s/step | ours padding % | FSDP2 padding % | ours peak at |"
    )
    lines = [head, "|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for p in projections:
        usable = p.gpu.usable_bytes
        fits = " / ".join("yes" if e.fits(usable) else "no" for e in (p.ours, p.fsdp2))
        mesh = f"{p.replicas}x{p.shard_ranks}" + (
            f", {p.layers_per_group} layers/group" if p.layers_per_group > 1 else ""
        )
        lines.append(
            f"| {p.model} | {p.world} | {mesh} | {_gb(p.ours.peak_bytes)} | "
            f"{_gb(p.fsdp2.peak_bytes)} | {_gb(usable)} | {fits} | {p.ours.step_s:.3f} | "
            f"{p.fsdp2.step_s:.3f} | {100 * p.ours.padding_ratio:.3f} | "
            f"{100 * p.fsdp2.padding_ratio:.3f} | {p.ours.peak_at} |"
        )
    return "\n".join(lines)


def _projection_json(projections: Sequence[Projection]) -> str:
    out = []
    for p in projections:
        row: dict[str, object] = {
            "model": p.model,
            "world": p.world,
            "shard_ranks": p.shard_ranks,
            "replicas": p.replicas,
            "layers_per_group": p.layers_per_group,
            "gpu": p.gpu.name,
            "usable_bytes": p.gpu.usable_bytes,
            "setup": attrs.asdict(p.setup),
        }
        for e in (p.ours, p.fsdp2):
            row[e.engine] = {
                "peak_bytes": e.peak_bytes,
                "peak_at": e.peak_at,
                "breakdown": dict(e.breakdown),
                "padding_ratio": e.padding_ratio,
                "step_s": e.step_s,
                "compute_s": e.compute_s,
                "exposed_comm_s": e.exposed_comm_s,
                "all_gather_s": e.all_gather_s,
                "reduce_s": e.reduce_s,
                "copy_s": e.copy_s,
                "optimizer_s": e.optimizer_s,
            }
        out.append(row)
    return json.dumps(out, indent=2)


def _load_specs(path: str) -> list[TensorSpec]:
    text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of tensor specs")
    return [
        TensorSpec(int(d["numel"]), int(d.get("block", 1)), str(d.get("name", ""))) for d in data
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "report":
            worlds = _ints(args.world, "--world")
            grans = [parse_granularity(t) for t in args.block_rows.split(",") if t.strip()]
            rows = report_rows(
                args.model or list(MODELS),
                worlds,
                grans,
                align_bytes=args.align_bytes,
                itemsize=args.itemsize,
            )
            print(format_json(rows) if args.format == "json" else format_table(rows))
        elif args.command == "plan":
            specs = _load_specs(args.specs)
            result = plan(specs, args.world, args.align, method=args.method)
            result.validate()
            print(
                json.dumps(
                    {
                        "shard_size": result.shard_size,
                        "world_size": result.world_size,
                        "align": result.align,
                        "padding": result.padding,
                        "padding_ratio": result.padding_ratio,
                        "lower_bound": lower_bound(specs, args.world, args.align),
                        "offsets": list(result.offsets),
                        "order": list(result.order),
                        "local_units": [list(result.local_units(i)) for i in range(len(specs))],
                        "fingerprint": result.fingerprint,
                    },
                    indent=2,
                )
            )
        elif args.command == "project":
            setup = _setup(args)
            gpu = GPUS[args.gpu]
            projections = [
                project(
                    catalogue_model(name),
                    world,
                    gpu,
                    setup,
                    shard_ranks=args.shard_ranks,
                    layers_per_group=args.layers_per_group,
                    merge_ends=args.merge_ends,
                )
                for name in args.model or list(MODELS)
                for world in _ints(args.world, "--world")
            ]
            out = _projection_json if args.format == "json" else _projection_rows
            print(out(projections))
        elif args.command == "advise":
            setup = _setup(args)
            budget = None if args.budget_gb is None else int(args.budget_gb * 1e9)
            advice = advise(
                catalogue_model(args.model),
                args.world,
                GPUS[args.gpu],
                setup,
                max_padding=args.max_padding / 100,
                budget_bytes=budget,
            )
            print(advice.explain())
            if advice.chosen is not None:
                r, shard = advice.mesh_shape
                print(
                    f"\nadvice: init_device_mesh(device, ({r}, {shard}), mesh_dim_names="
                    f'("replicate", "shard")); fully_shard groups (forward order): '
                    f"{_describe_groups(advice.module_groups(catalogue_model(args.model).layers))}"
                )
            else:
                return 1
        elif args.command == "plot":
            from shard_planner.projection._private.plots import plot_models

            written = plot_models(
                args.model or list(MODELS),
                _ints(args.world, "--world"),
                GPUS[args.gpu],
                _setup(args),
                Path(args.out),
            )
            for path in written:
                print(path)
        else:
            for name in MODELS:
                model = catalogue_model(name)
                print(f"{name}: {model.numel / 1e9:.2f}B parameters")
                for group in model.groups:
                    print(
                        f"  {group.name} x{group.count}: {len(group.weights)} tensors, "
                        f"{group.numel / 1e6:.1f}M elements"
                    )
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, and keep the interpreter's final
        # flush from raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (ValueError, TypeError, argparse.ArgumentTypeError, OSError) as exc:
        print(f"shard-planner: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _describe_groups(groups: Sequence[Sequence[str]]) -> str:
    """``[["embed"], ["0", "1"], ...]`` as ``embed | layers 0-1 | ...``."""
    parts = []
    for group in groups:
        names = [g for g in group if not g.isdigit()]
        layers = [int(g) for g in group if g.isdigit()]
        text = []
        if "embed" in names:
            text.append("embed")
        if layers:
            span = f"{layers[0]}-{layers[-1]}" if len(layers) > 1 else f"{layers[0]}"
            text.append(f"layers {span}")
        if "head" in names:
            text.append("norm + head")
        parts.append(" + ".join(text))
    if len(parts) > 6:
        parts = [*parts[:3], f"... ({len(parts) - 5} more)", *parts[-2:]]
    return " | ".join(parts)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
