"""The memory projection against measured peaks: the validation cases as a table.

Runs every case of ``tests/projection_toys.py`` (scaled-down catalogue models, world sizes 8,
64 and 256 under the fake process group, ours and torch's FSDP2) and prints measured peak,
projected peak and the error; ``tests/test_projection_validation.py`` asserts each within 5%.

Run: ``python benchmarks/bench_projection_memory.py [--out results]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))
from projection_toys import CASES, projected  # noqa: E402


def _label(case: dict[str, object]) -> str:
    extra = []
    if case["prefetch"]:
        extra.append(f"forward prefetch {case['prefetch']}")
    if case["layers_per_group"] != 1:
        extra.append(f"{case['layers_per_group']} layers/group")
    if case["seq"] != 32:
        extra.append(f"seq {case['seq']}")
    extra.append("bf16 + fp32 reduce" if case["bf16"] else "fp32")
    return ", ".join(extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    out = subprocess.run(
        [sys.executable, str(TESTS / "projection_toys.py"), json.dumps(CASES)],
        capture_output=True,
        text=True,
        check=True,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    lines = [
        "| engine | model (scaled) | m | setting | measured MiB | projected MiB | error |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    worst = 0.0
    for row in rows:
        peak, _ = projected(row)
        error = peak / row["peak"] - 1
        worst = max(worst, abs(error))
        engine = "ours" if row["engine"] == "ours" else "FSDP2"
        lines.append(
            f"| {engine} | {row['model']} | {row['world']} | {_label(row)} | "
            f"{row['peak'] / 2**20:.2f} | {peak / 2**20:.2f} | {100 * error:+.2f}% |"
        )
    text = "\n".join(lines) + f"\n\nlargest error: {100 * worst:.2f}% over {len(rows)} cases\n"
    print(text)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_projection_memory.md").write_text(text)


if __name__ == "__main__":
    main()
