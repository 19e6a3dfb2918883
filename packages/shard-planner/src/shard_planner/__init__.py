"""shard_planner: pack a group's tensors into one flat buffer of equal shards, no block cut.

This is the packing core (specs, plans, the search, the exact solver, the lower bound, the
baseline layouts). What a whole model costs at scale (catalogue, hardware, projection, mesh
advisor, report, plots, the ``shard-planner`` command) is the ``shard_planner.projection``
subpackage, built on this API only; nothing here imports it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from shard_planner._private.baselines import Fsdp2Layout, fsdp2_layout, megatron_plan, naive_plan
from shard_planner._private.exact import MAX_EXACT_TENSORS, exact_plan
from shard_planner._private.plan import Plan, Slice
from shard_planner._private.search import METHODS, lower_bound, plan
from shard_planner._private.spec import TensorSpec


def _version() -> str:
    try:
        return version("shard-planner")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0+unknown"


__version__ = _version()

__all__ = [
    "TensorSpec",
    "Plan",
    "Slice",
    "plan",
    "METHODS",
    "lower_bound",
    "exact_plan",
    "MAX_EXACT_TENSORS",
    "naive_plan",
    "megatron_plan",
    "fsdp2_layout",
    "Fsdp2Layout",
    "__version__",
]
