"""shard_planner.projection: what a whole model costs at scale, ours vs FSDP2.

Built on the packing core (``shard_planner.plan``, ``TensorSpec``, ``lower_bound``,
``fsdp2_layout``, ``METHODS``), reached only through ``shard_planner``'s public API; the core
never imports this subpackage (``tests/test_architecture.py`` enforces both). numpy + attrs, no
torch, like the core.

- the catalogue: every weight shape of public models, grouped per layer as FSDP wraps them, with
  blocks from a row or tile granularity (``MODELS``, ``catalogue_model``, ``Model``, ``Group``,
  ``Weight``, ``LayerShape``);
- hardware: accelerators and networks with their sources (``GPUS``, ``Gpu``, ``NETWORKS``,
  ``Network``);
- the projection: per-rank peak memory and step time of a training step (``project``,
  ``Setup``, ``Projection``, ``EngineProjection``, ``GroupLayout``, ``OPTIMIZERS``);
- the mesh advisor: the HSDP factorisation and layer grouping to run (``advise``, ``Advice``,
  ``Candidate``, ``LAYER_CHOICES``);
- the ``shard-planner`` command (``report``, ``project``, ``advise``, ``plot``, ``plan``,
  ``models``).
"""

from __future__ import annotations

from shard_planner.projection._private.advise import LAYER_CHOICES, Advice, Candidate, advise
from shard_planner.projection._private.catalogue import (
    MODELS,
    Group,
    LayerShape,
    Model,
    Weight,
    catalogue_model,
)
from shard_planner.projection._private.hardware import GPUS, NETWORKS, Gpu, Network
from shard_planner.projection._private.project import (
    OPTIMIZERS,
    EngineProjection,
    GroupLayout,
    Projection,
    Setup,
    project,
)

__all__ = [
    # the catalogue
    "MODELS",
    "Model",
    "Group",
    "Weight",
    "LayerShape",
    "catalogue_model",
    # hardware
    "GPUS",
    "Gpu",
    "NETWORKS",
    "Network",
    # the projection
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
]
