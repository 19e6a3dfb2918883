"""PNG plots of the projection: padding vs m and peak memory vs m, ours vs FSDP2, per model.

Needs matplotlib (``pip install shard-planner[plot]``); everything else of the package works
without it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from shard_planner.projection._private.catalogue import catalogue_model
from shard_planner.projection._private.hardware import Gpu
from shard_planner.projection._private.project import Setup, project

__all__ = ["plot_models"]


def plot_models(
    models: Sequence[str], worlds: Sequence[int], gpu: Gpu, setup: Setup, out: Path
) -> list[Path]:
    """One PNG per model (two panels: padding %, peak GB with the GPU's usable memory)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise OSError("plots need matplotlib: pip install 'shard-planner[plot]'") from exc
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in models:
        model = catalogue_model(name)
        rows = [project(model, m, gpu, setup) for m in worlds]
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6), constrained_layout=True)
        if setup.block_rows != 16:  # what blockwise optimizers need, for comparison
            blocked = attrs.evolve(setup, block_rows=16, tile=False)
            pad16 = [100 * project(model, m, gpu, blocked).ours.padding_ratio for m in worlds]
            left.plot(
                worlds,
                [max(v, 1e-3) for v in pad16],
                "^:",
                color="tab:cyan",
                label="ours, 16-row blocks",
            )
        for engine, style, color in (("ours", "o-", "tab:blue"), ("fsdp2", "s--", "tab:orange")):
            label = "ours" if engine == "ours" else "FSDP2 (even dim-0 split)"
            pad = [100 * getattr(p, engine).padding_ratio for p in rows]
            peak = [getattr(p, engine).peak_bytes / 1e9 for p in rows]
            left.plot(worlds, [max(v, 1e-3) for v in pad], style, color=color, label=label)
            right.plot(worlds, peak, style, color=color, label=label)
        right.axhline(gpu.usable_bytes / 1e9, color="grey", lw=1, ls=":")
        right.text(worlds[0], gpu.usable_bytes / 1e9, f" {gpu.name} usable", va="bottom")
        gran = (
            "no block structure"
            if setup.block_rows == 0
            else (
                f"{setup.block_rows}x{setup.block_rows} tiles"
                if setup.tile
                else f"{setup.block_rows}-row blocks"
            )
        )
        left.set(
            xscale="log",
            yscale="log",
            xlabel="ranks (FSDP)",
            ylabel="padding, % of parameters (floor 0.001)",
            title=f"{name}: padding ({gran})",
        )
        right.set(
            xscale="log",
            yscale="log",
            xlabel="ranks (FSDP)",
            ylabel="projected peak per rank, GB",
            title=f"{name}: peak memory (seq {setup.seq} x {setup.micro_batch})",
        )
        for ax in (left, right):
            ax.set_xticks(list(worlds))
            ax.set_xticklabels([str(w) for w in worlds], rotation=45, fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        path = out / f"projection_{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
