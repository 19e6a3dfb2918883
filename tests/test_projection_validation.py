"""The memory projection of shard-planner against measured peaks of the engines.

Scaled-down catalogue models (the catalogue's structure and parameter names, small widths; see
``projection_toys``) train two steps under the fake process group at world sizes 8, 64 and 256
(rank 0 allocates exactly what it would in a real run; collectives move nothing). The peak of
live storage over the second step, tallied by ``dbuffer.testing.LiveBytes``, is compared with
``shard_planner.projection.project`` for the same model, world size, dtypes, micro-batch and
prefetch depth: within 5% for ours (``fsdp_engine``) and for torch's FSDP2. The comparison is of
sizes, not of arithmetic: no tolerance depends on floating-point results. The shard sizes the engine
planned must equal the projection's (both run the same planner on the same groups).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from projection_toys import CASES, projected

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.05


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
    peak, shards = projected(row)
    error = peak / row["peak"] - 1
    where = f"{row['engine']} {row['model']} m={row['world']} (case {CASES[index]})"
    assert abs(error) <= TOLERANCE, f"{where}: projected {peak} vs measured {row['peak']}"
    if row["engine"] == "ours":
        assert row["shards"] == shards, (
            f"{where}: engine planned {row['shards']}, projection {shards}"
        )
