"""``shard-planner``: the scale report, one-off plans, and the model catalogue.

shard-planner report --model gpt-oss-120b --world 64,256 --block-rows 1,16,128,32x32
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

from shard_planner._private.catalogue import MODELS, catalogue_model
from shard_planner._private.report import (
    format_json,
    format_table,
    parse_granularity,
    report_rows,
)
from shard_planner._private.search import METHODS, lower_bound, plan
from shard_planner._private.spec import TensorSpec

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
    return parser


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
