"""The demo's loss plot (run by ``nox -s newcomer`` in ``.venv``, where matplotlib is installed):
the title names the engine that ran, the legend has no jargon, step ticks are whole numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import demo


@pytest.mark.parametrize(
    ("engine", "label"),
    [("fsdp-engine", "fsdp_engine.fully_shard"), ("fsdp2", "torch FSDP2 (fully_shard)")],
)
@pytest.mark.parametrize("steps", [2, 3, 7, 300])
def test_the_plot_names_the_engine_and_ticks_whole_steps(
    engine: str, label: str, steps: int
) -> None:
    args = demo.parse(["--engine", engine, "--steps", str(steps)], env={})
    args.world = args.world_size
    record = {"losses": [4.0 - 0.01 * i for i in range(steps)], "val": [(steps, 3.5)]}
    fig = demo.loss_figure(args, record)
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_title().startswith(label), ax.get_title()
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == ["train (mean over 2 ranks)", "validation"]
    low, high = ax.get_xlim()
    shown = [t for t in ax.get_xticks() if low <= t <= high]
    assert shown and all(float(t).is_integer() for t in shown), shown
