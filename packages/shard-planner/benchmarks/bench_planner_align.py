"""Planning 100,000 tensors with 16-byte aligned starts: the method, then the aligned pass.

Run: ``python packages/shard-planner/benchmarks/bench_planner_align.py [--tensors 100000]``.
Prints one row per case: the method's time (``plan`` without ``offset_align``), the aligned
pass's time on that plan (``_private.align.aligned_plan``), the whole ``plan(...,
offset_align=)`` call, and the shard sizes. Times are ``time.process_time`` (CPU time of this
process, so other jobs on a shared machine inflate them less than wall time), the minimum of
``--repeat`` runs. Figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

import shard_planner as sp
from shard_planner._private.align import aligned_plan

T = TypeVar("T")


def _timed(fn: Callable[[], T], repeat: int) -> tuple[T, float]:
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.process_time()
        out = fn()
        best = min(best, time.process_time() - start)
    assert out is not None
    return out, best


def _cases(n: int) -> list[tuple[str, list[sp.TensorSpec], int, int]]:
    rng = random.Random(0)
    linear = [sp.TensorSpec(4 if i % 2 == 0 else 2, 1, f"{i // 2}.{'wb'[i % 2]}") for i in range(n)]
    mixed = []
    for i in range(n):
        block = rng.choice((1, 1, 1, 4, 16, 128))
        mixed.append(sp.TensorSpec(block * rng.choice((1, 2, 3, 5, 8)), block, f"t{i}"))
    return [
        ("Linear(2, 2) weights+biases, fp32 (align 4)", linear, 2, 4),
        ("Linear(2, 2) weights+biases, fp32 (align 4)", linear, 8, 4),
        ("Linear(2, 2) weights+biases, bf16 compute (align 8)", linear, 64, 8),
        ("mixed blocks 1..128 elements (align 8)", mixed, 8, 8),
        ("mixed blocks 1..128 elements (align 8)", mixed, 1024, 8),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()
    print(
        "| case | tensors | m | method s | aligned pass s | plan(offset_align) s "
        "| S free | S aligned |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, specs, world, align in _cases(args.tensors):
        free, t_free = _timed(partial(sp.plan, specs, world, align), args.repeat)
        aligned, t_pass = _timed(partial(aligned_plan, free, align), args.repeat)
        whole, t_whole = _timed(
            partial(sp.plan, specs, world, align, offset_align=align), args.repeat
        )
        assert whole == aligned
        aligned.validate()
        print(
            f"| {name} | {len(specs)} | {world} | {t_free:.2f} | {t_pass:.3f} | {t_whole:.2f} "
            f"| {free.shard_size} | {aligned.shard_size} |"
        )


if __name__ == "__main__":
    main()
