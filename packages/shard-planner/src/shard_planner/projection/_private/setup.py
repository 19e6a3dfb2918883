"""What a projection is of: the step's setup and each group's layout, ours vs FSDP2.

[Note: what is projected]
One training step (forward, backward, optimizer step) of one micro-batch on a ``replicate x
shard`` mesh (HSDP; ``replicate = 1`` is plain FSDP). The model's groups are the catalogue's
(embedding, decoder layers, final norm + head), decoder layers optionally stacked ``k`` per
group. For each group the layout decides the per-rank shard and the gathered buffer:
- ours: the planner's plan at the shard-group size (``plan(specs, shard, align,
  offset_align=align)`` with the engine's alignment: every shard size and tensor offset a
  multiple of 16 bytes in the parameter, compute and reduce dtypes): every rank stores ``S``
  elements, the gathered buffer is ``shard * S``, no copies (the buffer is the parameters'
  storage);
- FSDP2: every parameter split evenly on dim 0 (``ceil(d0 / shard)`` rows per rank, padding
  included), the all-gather output and the unsharded parameters both ``shard`` times that
  (padded), and a copy-in, a copy-out and a reduce-scatter copy-in per group.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from shard_planner import TensorSpec, plan
from shard_planner.projection._private.catalogue import Group, Model, Weight
from shard_planner.projection._private.hardware import NETWORKS

__all__ = ["OPTIMIZERS", "GroupLayout", "Setup", "fsdp2_shard", "layouts", "ours_shard"]

# Optimizer state bytes per parameter element, and whether its step needs a shard-size temporary.
OPTIMIZERS: dict[str, tuple[float, bool]] = {
    "adamw": (8.0, True),  # two fp32 moments; foreach sqrt of the second moment out of place
    "adamw8bit": (2.0 + 8.0 / 256, False),  # two 8-bit moments + an fp32 absmax per 256
    "sgd": (0.0, False),
    "sgd-momentum": (4.0, False),
    "muon": (4.0, False),  # fp32 momentum (Newton-Schulz temporaries not counted)
}


@attrs.frozen
class Setup:
    """What the projection assumes about the run (every default stated)."""

    seq: int = 4096
    micro_batch: int = 1
    activation_checkpointing: bool = False
    param_bytes: int = 4  # fp32 parameters (and their shards, and sharded gradients)
    compute_bytes: int = 2  # bf16 gathered parameters, activations, unsharded gradients
    reduce_bytes: int = 4  # fp32 gradient reduction
    optimizer: str = "adamw"
    mfu: float = 0.4  # assumption: model FLOPs utilisation of the compute
    forward_prefetch: int = 1  # groups all-gathered ahead in forward (FSDP2: 1, implicitly)
    backward_prefetch: int = 1  # and in backward (both engines default to 1)
    block_rows: int = 0  # our planner's blocks: rows (tiles with ``tile``); 0: 1 element
    tile: bool = False
    align_bytes: int = 16
    network: str = "ib400"

    def __attrs_post_init__(self) -> None:
        for name in ("seq", "micro_batch", "param_bytes", "compute_bytes", "reduce_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"Setup.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("forward_prefetch", "backward_prefetch"):
            if getattr(self, name) < 0:
                raise ValueError(f"Setup.{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.mfu <= 1:
            raise ValueError(f"Setup.mfu must be in (0, 1], got {self.mfu}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Setup.optimizer must be one of {sorted(OPTIMIZERS)}")
        if self.network not in NETWORKS:
            raise ValueError(f"Setup.network must be one of {sorted(NETWORKS)}")

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    @property
    def align(self) -> int:
        """Elements per ``align_bytes`` in every dtype the engine views a group in (parameter,
        compute, reduce): fsdp_engine aligns shard sizes and tensor offsets to this."""
        sizes = (self.param_bytes, self.compute_bytes, self.reduce_bytes)
        return math.lcm(1, *(max(1, self.align_bytes // size) for size in sizes))


@attrs.frozen
class GroupLayout:
    """One ``fully_shard`` group of the schedule as an engine lays it out on one shard group.

    ``parts`` are the catalogue groups it holds and how many copies of each (``k`` decoder
    layers; with merged ends also the embedding or the head).
    """

    name: str
    parts: tuple[tuple[Group, int], ...]
    count: int  # consecutive repeats in forward order
    numel: int  # parameters
    shard: int  # elements a rank stores (ours: S; FSDP2: its padded dim-0 chunks)
    gathered: int  # elements of the unsharded buffer (shard-group size x shard)

    @property
    def padding(self) -> int:
        return self.gathered - self.numel

    @property
    def layers(self) -> int:
        """Decoder layers in the group."""
        return sum(n for g, n in self.parts if not _is_end(g))

    @property
    def weights(self) -> list[Weight]:
        return [w for g, n in self.parts for _ in range(n) for w in g.weights]

    def specs(self, setup: Setup) -> list[TensorSpec]:
        """The planner's input (each copy's names prefixed by its index)."""
        out: list[TensorSpec] = []
        copies = sum(n for _, n in self.parts)
        index = 0
        for group, n in self.parts:
            for _ in range(n):
                for spec in group.specs(setup.block_rows, tile=setup.tile):
                    name = f"{index}.{spec.name}" if copies > 1 else spec.name
                    out.append(TensorSpec(spec.numel, spec.block, name))
                index += 1
        return out


def _is_end(group: Group) -> bool:
    return group.layer is not None and group.layer.kind in ("embed", "head")


_PLAN_CACHE: dict[tuple[object, ...], int] = {}


def ours_shard(specs: Sequence[TensorSpec], shard_ranks: int, align: int) -> int:
    """Our planner's shard size for these tensors (cached: the advisor asks many times)."""
    key = (tuple((s.numel, s.block) for s in specs), shard_ranks, align)
    if key not in _PLAN_CACHE:
        if len(_PLAN_CACHE) > 4096:
            _PLAN_CACHE.clear()
        _PLAN_CACHE[key] = plan(specs, shard_ranks, align, offset_align=align).shard_size
    return _PLAN_CACHE[key]


def fsdp2_shard(weights: Sequence[Weight], shard_ranks: int) -> int:
    """FSDP2's per-rank elements: ``ceil(d0 / m)`` rows of every parameter (padded)."""
    total = 0
    for w in weights:
        dims = w.shape or (1,)
        total += -(-dims[0] // shard_ranks) * math.prod(dims[1:])
    return total


def _units(
    model: Model, layers_per_group: int, merge_ends: bool
) -> list[tuple[tuple[Group, int], ...]]:
    """The groups in forward order as parts; decoder layers ``k`` at a time (within a run of
    identical layers), the embedding and the head alone or merged into their neighbours."""
    units: list[tuple[tuple[Group, int], ...]] = []
    for group in model.groups:
        if _is_end(group):
            units.append(((group, 1),))
            continue
        k = min(layers_per_group, group.count)
        full, rest = divmod(group.count, k)
        units += [((group, k),)] * full + ([((group, rest),)] if rest else [])
    if merge_ends and len(units) >= 3:
        units[1] = units[0] + units[1]
        units[-2] = units[-2] + units[-1]
        units = units[1:-1]
    return units


def layouts(
    model: Model,
    shard_ranks: int,
    layers_per_group: int,
    setup: Setup,
    engine: str,
    *,
    merge_ends: bool = False,
) -> list[GroupLayout]:
    """The groups in forward order, consecutive identical ones counted once."""
    if layers_per_group < 1:
        raise ValueError(f"layers_per_group must be >= 1, got {layers_per_group}")
    out: list[GroupLayout] = []
    for parts in _units(model, layers_per_group, merge_ends):
        if out and out[-1].parts == parts:
            out[-1] = attrs.evolve(out[-1], count=out[-1].count + 1)
            continue
        numel = sum(g.numel * n for g, n in parts)
        probe = GroupLayout("", parts, 1, numel, 0, 0)
        if engine == "ours":
            shard = ours_shard(probe.specs(setup), shard_ranks, setup.align)
        else:
            shard = fsdp2_shard(probe.weights, shard_ranks)
        name = " + ".join(g.name if n == 1 else f"{g.name} x{n}" for g, n in parts)
        out.append(GroupLayout(name, parts, 1, numel, shard, shard * shard_ranks))
    return out
