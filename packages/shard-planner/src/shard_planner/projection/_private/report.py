"""The scale report: padding of our planner vs the baselines vs the lower bound, per model.

[Note: what a row measures]
One row is one model at one world size and one block granularity. Every distinct FSDP group of
the model (``catalogue``) is planned by each method; padding is summed over all groups weighted
by how many times the model repeats them, and reported as a percentage of the model's
parameters. Bytes per rank: the sharded buffer is what a rank stores for the whole model
(``sum count * S``), the gathered buffer is the largest group's unsharded buffer (``m * S``), the
peak a rank materialises while that group is gathered. FSDP2 stores ``ceil(dim0/m)`` rows of each
tensor per rank and gathers ``m`` times that; "fsdp2 cuts" counts the tensors (over the whole
model) whose ``ceil(dim0/m)``-row chunks cut a block, i.e. where FSDP2's padding figure is bought
by breaking the block constraint our plans keep. The planner time is the slowest group's, measured
once here (a figure, not a test).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

import attrs

from shard_planner import TensorSpec, fsdp2_layout, lower_bound, plan
from shard_planner.projection._private.catalogue import Group, Model, catalogue_model

__all__ = [
    "Granularity",
    "ReportRow",
    "format_json",
    "format_table",
    "parse_granularity",
    "report_rows",
]

_MIB = 1 << 20


@attrs.frozen
class Granularity:
    """A block granularity: ``rows`` rows per block, or ``rows x rows`` tiles (``tile``; the
    catalogue's block rule); ``label`` as the user wrote it."""

    label: str
    rows: int
    tile: bool = False

    def specs(self, group: Group) -> list[TensorSpec]:
        return group.specs(self.rows, tile=self.tile)


def parse_granularity(text: str) -> Granularity:
    """``"16"`` (rows) or ``"32x32"`` (square tiles of each matrix kept whole, see catalogue)."""
    raw = text.strip().lower()
    try:
        if "x" in raw:
            r, c = (int(v) for v in raw.split("x", 1))
            if r < 1 or c < 1 or r != c:
                raise ValueError
            return Granularity(f"{r}x{c}", r, tile=True)
        rows = int(raw)
        if rows < 1:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"block granularity {text!r}: expected rows (e.g. 16) or a square tile "
            f"(e.g. 32x32) with positive sizes"
        ) from None
    return Granularity(raw, rows)


@attrs.frozen
class ReportRow:
    model: str
    world_size: int
    granularity: str
    ours: float
    paper: float
    naive: float
    megatron: float
    fsdp2: float
    lower_bound: float
    shard_mib: float
    fsdp2_shard_mib: float
    gathered_mib: float
    fsdp2_gathered_mib: float
    fsdp2_cut_tensors: int
    plan_ms: float
    groups: int


def _row(model: Model, world: int, gran: Granularity, align: int, itemsize: int) -> ReportRow:
    padding = {k: 0 for k in ("ours", "paper", "naive", "megatron", "fsdp2", "lb")}
    shard = fsdp2_shard = 0
    gathered = fsdp2_gathered = 0
    cut = 0
    slowest = 0.0
    for group in model.groups:
        specs = gran.specs(group)
        start = time.process_time()
        ours = plan(specs, world, align)
        slowest = max(slowest, time.process_time() - start)
        others = {
            name: plan(specs, world, align, method=name) for name in ("paper", "naive", "megatron")
        }
        fsdp2 = fsdp2_layout([w.shape for w in group.weights], [s.block for s in specs], world)
        bound = lower_bound(specs, world, align)
        n = group.count
        padding["ours"] += n * ours.padding
        for name, other in others.items():
            padding[name] += n * other.padding
        padding["fsdp2"] += n * fsdp2.padding
        padding["lb"] += n * (world * bound - group.numel)
        shard += n * ours.shard_size
        fsdp2_shard += n * fsdp2.shard_numel
        gathered = max(gathered, ours.buffer_numel)
        fsdp2_gathered = max(fsdp2_gathered, fsdp2.buffer_numel)
        cut += n * len(fsdp2.cuts_blocks)
    total = model.numel

    def pct(value: int) -> float:
        return 100.0 * value / total

    return ReportRow(
        model=model.name,
        world_size=world,
        granularity=gran.label,
        ours=pct(padding["ours"]),
        paper=pct(padding["paper"]),
        naive=pct(padding["naive"]),
        megatron=pct(padding["megatron"]),
        fsdp2=pct(padding["fsdp2"]),
        lower_bound=pct(padding["lb"]),
        shard_mib=shard * itemsize / _MIB,
        fsdp2_shard_mib=fsdp2_shard * itemsize / _MIB,
        gathered_mib=gathered * itemsize / _MIB,
        fsdp2_gathered_mib=fsdp2_gathered * itemsize / _MIB,
        fsdp2_cut_tensors=cut,
        plan_ms=slowest * 1e3,
        groups=len(model.groups),
    )


def report_rows(
    models: Sequence[str],
    worlds: Sequence[int],
    granularities: Sequence[Granularity],
    *,
    align_bytes: int = 16,
    itemsize: int = 2,
) -> list[ReportRow]:
    """Rows for every (model, world size, granularity); ``align = align_bytes / itemsize``."""
    if itemsize < 1 or align_bytes < 1 or align_bytes % itemsize != 0:
        raise ValueError(
            f"align_bytes {align_bytes} must be a positive multiple of itemsize {itemsize}"
        )
    align = align_bytes // itemsize
    rows: list[ReportRow] = []
    for name in models:
        model = catalogue_model(name)
        for world in worlds:
            if world < 1:
                raise ValueError(f"world size must be >= 1, got {world}")
            for gran in granularities:
                rows.append(_row(model, world, gran, align, itemsize))
    return rows


_COLUMNS = [
    ("model", "model", "{}"),
    ("world_size", "m", "{}"),
    ("granularity", "block", "{}"),
    ("ours", "ours %", "{:.3f}"),
    ("lower_bound", "bound %", "{:.3f}"),
    ("paper", "paper %", "{:.3f}"),
    ("naive", "naive %", "{:.3f}"),
    ("megatron", "megatron %", "{:.3f}"),
    ("fsdp2", "fsdp2 %", "{:.3f}"),
    ("fsdp2_cut_tensors", "fsdp2 cuts", "{}"),
    ("shard_mib", "shard MiB", "{:.1f}"),
    ("fsdp2_shard_mib", "fsdp2 shard MiB", "{:.1f}"),
    ("gathered_mib", "gathered MiB", "{:.1f}"),
    ("fsdp2_gathered_mib", "fsdp2 gathered MiB", "{:.1f}"),
    ("plan_ms", "plan ms", "{:.1f}"),
]


def format_table(rows: Sequence[ReportRow]) -> str:
    """A Markdown table (readable in a terminal too)."""
    head = "| " + " | ".join(title for _, title, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" if i < 3 else "---:" for i in range(len(_COLUMNS))) + "|"
    lines = [head, rule]
    for row in rows:
        cells = [fmt.format(getattr(row, key)) for key, _, fmt in _COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def format_json(rows: Sequence[ReportRow]) -> str:
    return json.dumps([attrs.asdict(r) for r in rows], indent=2)
