"""The memory projection of shard-planner against measured peaks of the engines.

Scaled-down catalogue models (the catalogue's structure and parameter names, small widths; see
``projection_toys``) train two steps under the fake process group at world sizes 8, 64 and 256
(rank 0 allocates exactly what it would in a real run; collectives move nothing). The peak of
live storage over the second step, tallied by ``dbuffer.LiveBytes``, is compared with
``shard_planner.project`` for the same model, world size, dtypes, micro-batch and prefetch
depth: within 5% for ours (``fsdp_engine``) and for torch's FSDP2. The comparison is of sizes,
not of arithmetic: no tolerance depends on floating-point results. The shard sizes the engine
planned must equal the projection's (both run the same planner on the same groups).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shard_planner import GPUS, Setup, catalogue_model, project

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.05

SCALED = {
    "llama3-8b": {
        "hidden": 128,
        "layers": 3,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "ffn": 384,
        "vocab": 512,
    },
    "qwen3-30b-a3b": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "vocab": 512,
        "experts": 8,
        "experts_per_token": 2,
        "expert_ffn": 96,
    },
    "gpt-oss-120b": {
        "hidden": 128,
        "layers": 2,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 32,
        "vocab": 512,
        "experts": 8,
        "experts_per_token": 2,
        "expert_ffn": 96,
    },
}


def _case(model: str, world: int, engine: str = "ours", **extra: Any) -> dict[str, Any]:
    case = {
        "model": model,
        "overrides": SCALED[model],
        "world": world,
        "seq": 32,
        "micro_batch": 2,
        "prefetch": 0,
        "layers_per_group": 1,
        "engine": engine,
        "bf16": False,
    }
    case.update(extra)
    return case


CASES = [
    *(_case(m, w, e) for e in ("ours", "fsdp2") for m in SCALED for w in (8, 64, 256)),
    # our forward prefetch, several layers per group, long sequences, bf16 + fp32 reduction
    _case("llama3-8b", 64, prefetch=1),
    _case("llama3-8b", 64, layers_per_group=2),
    _case("llama3-8b", 8, seq=256),
    _case("gpt-oss-120b", 256, bf16=True, prefetch=1),
    _case("qwen3-30b-a3b", 64, bf16=True),
    _case("gpt-oss-120b", 256, "fsdp2", bf16=True),
    _case("llama3-8b", 64, "fsdp2", bf16=True),
]


def _projected(case: dict[str, Any]) -> tuple[int, list[int]]:
    model = catalogue_model(case["model"], case["overrides"])
    setup = Setup(
        seq=case["seq"],
        micro_batch=case["micro_batch"],
        param_bytes=4,
        compute_bytes=2 if case["bf16"] else 4,
        reduce_bytes=4,
        forward_prefetch=case["prefetch"],
        backward_prefetch=1,  # both engines' default
    )
    p = project(model, case["world"], GPUS["H100"], setup, layers_per_group=case["layers_per_group"])
    engine = p.ours if case["engine"] == "ours" else p.fsdp2
    shards = [g.shard for g in engine.groups for _ in range(g.count)]
    return engine.peak_bytes, shards


@pytest.fixture(scope="module")
def measured() -> list[dict[str, Any]]:
    out = subprocess.run(
        [sys.executable, str(HERE / "projection_toys.py"), json.dumps(CASES)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(rows) == len(CASES)
    return rows


@pytest.mark.parametrize("index", range(len(CASES)))
def test_projected_peak_within_five_percent(measured: list[dict[str, Any]], index: int) -> None:
    row = measured[index]
    peak, shards = _projected(row)
    error = peak / row["peak"] - 1
    where = f"{row['engine']} {row['model']} m={row['world']} (case {CASES[index]})"
    assert abs(error) <= TOLERANCE, f"{where}: projected {peak} vs measured {row['peak']}"
    if row["engine"] == "ours":
        assert row["shards"] == shards, f"{where}: engine planned {row['shards']}, projection {shards}"
