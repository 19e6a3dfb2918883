"""shard_planner: pack a group's tensors into one flat buffer of equal shards, no block cut."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from shard_planner._private.advise import LAYER_CHOICES, Advice, Candidate, advise
from shard_planner._private.baselines import Fsdp2Layout, fsdp2_layout, megatron_plan, naive_plan
from shard_planner._private.catalogue import (
    MODELS,
    Group,
    LayerShape,
    Model,
    Weight,
    catalogue_model,
)
from shard_planner._private.exact import MAX_EXACT_TENSORS, exact_plan
from shard_planner._private.hardware import GPUS, NETWORKS, Gpu, Network
from shard_planner._private.plan import Plan, Slice
from shard_planner._private.project import (
    OPTIMIZERS,
    EngineProjection,
    GroupLayout,
    Projection,
    Setup,
    project,
)
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
    # the catalogue
    "MODELS",
    "Model",
    "Group",
    "Weight",
    "LayerShape",
    "catalogue_model",
    # the projection
    "GPUS",
    "Gpu",
    "NETWORKS",
    "Network",
    "OPTIMIZERS",
    "Setup",
    "project",
    "Projection",
    "EngineProjection",
    "GroupLayout",
    # the advisor
    "advise",
    "Advice",
    "Candidate",
    "LAYER_CHOICES",
    "__version__",
]
