"""The mesh advisor: which HSDP factorisation and which layer grouping to run at a given scale.

[Note: the search]
For every shard-group size ``s`` dividing the world size (HSDP: ``world / s`` replicas; ``s =
world`` is plain FSDP), decoder layers are grouped ``k`` per ``fully_shard`` group for the
smallest ``k`` in ``LAYER_CHOICES`` whose model-wide padding (our planner's, at ``s`` ranks) is
at most ``max_padding``, first with the embedding and the head as groups of their own, then
with them merged into the first and last layer groups: a layer alone stops tiling evenly once
its blocks outgrow the per-rank share, and stacking gives the planner more tensors to fill the
gaps, at the price of a larger gathered buffer. Each ``(s, k)`` is projected (``project``);
candidates over the memory budget or over the padding limit are rejected, and the fastest projected
step among the rest is chosen (ties: less memory, then larger shard groups). Every rejection keeps
its reason, so the advice can say why it is what it is.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from shard_planner.projection._private.catalogue import Model
from shard_planner.projection._private.hardware import Gpu
from shard_planner.projection._private.project import Projection, Setup, project

__all__ = ["LAYER_CHOICES", "Advice", "Candidate", "advise"]

LAYER_CHOICES = (1, 2, 3, 4, 6, 8)
_GB = 1e9


@attrs.frozen
class Candidate:
    """One mesh shape and grouping, its projection, and the verdict."""

    shard_ranks: int
    replicas: int
    layers_per_group: int
    merge_ends: bool  # the embedding in the first layer group, the head in the last
    padding_ratio: float
    peak_bytes: int
    step_s: float
    fits: bool
    padding_ok: bool
    verdict: str

    @property
    def acceptable(self) -> bool:
        return self.fits and self.padding_ok


@attrs.frozen
class Advice:
    model: str
    world: int
    gpu: Gpu
    setup: Setup
    budget_bytes: int
    max_padding: float
    candidates: tuple[Candidate, ...]
    chosen: Candidate | None
    projection: Projection | None  # of the chosen candidate (ours and FSDP2 on that mesh)

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(replicate, shard)``: the 2-D device mesh to build (``init_device_mesh``)."""
        if self.chosen is None:
            raise ValueError(f"no mesh fits: {self.explain()}")
        return (self.chosen.replicas, self.chosen.shard_ranks)

    @property
    def mesh_dim_names(self) -> tuple[str, str]:
        """The names of ``mesh_shape``'s dimensions, for ``init_device_mesh(...,
        mesh_dim_names=...)`` (a 2-D mesh is HSDP to ``fully_shard``, which wants them named)."""
        return ("replicate", "shard")

    def module_groups(self, layers: int) -> list[list[str]]:
        """What to pass to each ``fully_shard`` call, in forward order, for a model of
        ``layers`` identical decoder layers: ``"embed"``, ``"head"`` and layer indices (as
        strings) per group."""
        if self.chosen is None:
            raise ValueError(f"no mesh fits: {self.explain()}")
        k = self.chosen.layers_per_group
        groups = [[str(j) for j in range(i, min(i + k, layers))] for i in range(0, layers, k)]
        if self.chosen.merge_ends and groups:
            groups[0].insert(0, "embed")
            groups[-1].append("head")
            return groups
        return [["embed"], *groups, ["head"]]

    def explain(self) -> str:
        lines = [
            f"{self.model} on {self.world} x {self.gpu.name} ({self.budget_bytes / _GB:.1f} GB "
            f"usable per GPU), padding limit {100 * self.max_padding:g}%:"
        ]
        for c in self.candidates:
            mark = "->" if c is self.chosen else "  "
            lines.append(
                f"{mark} shard {c.shard_ranks:>6} x replicate {c.replicas:<5} "
                f"{c.layers_per_group} layer(s)/group{', ends merged' if c.merge_ends else ''}: "
                f"padding {100 * c.padding_ratio:7.3f}%, "
                f"peak {c.peak_bytes / _GB:7.1f} GB, step {c.step_s:8.3f} s  {c.verdict}"
            )
        if self.chosen is None:
            lines.append("no candidate fits the memory budget within the padding limit")
        return "\n".join(lines)


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def advise(
    model: Model,
    world: int,
    gpu: Gpu,
    setup: Setup = Setup(),  # noqa: B008 - frozen value
    *,
    max_padding: float = 0.01,
    budget_bytes: int | None = None,
    shard_choices: Sequence[int] | None = None,
) -> Advice:
    """Choose the shard-group size and the layer grouping (module Note).

    ``budget_bytes`` defaults to the GPU's usable memory; ``shard_choices`` to every divisor
    of ``world`` (a shard group smaller than the model's memory needs is rejected anyway).
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    if not max_padding >= 0:
        raise ValueError(f"max_padding must be >= 0, got {max_padding}")
    budget = gpu.usable_bytes if budget_bytes is None else budget_bytes
    choices = sorted(shard_choices) if shard_choices is not None else _divisors(world)
    for s in choices:
        if s < 1 or world % s:
            raise ValueError(f"shard choice {s} does not divide the world size {world}")
    layers = model.layers
    options = [(k, False) for k in LAYER_CHOICES if k <= max(layers, 1)]
    options += [(k, True) for k, _ in options]
    candidates: list[Candidate] = []
    projections: list[Projection] = []
    for s in reversed(choices):
        tried: list[Projection] = []
        for k, merge in options:
            tried.append(
                project(
                    model, world, gpu, setup, shard_ranks=s, layers_per_group=k, merge_ends=merge
                )
            )
            if tried[-1].ours.padding_ratio <= max_padding:
                break
        # the first grouping within the limit, else the one with the least padding
        p = (
            tried[-1]
            if tried[-1].ours.padding_ratio <= max_padding
            else min(tried, key=lambda q: q.ours.padding_ratio)
        )
        ours = p.ours
        fits = ours.peak_bytes <= budget
        padding_ok = ours.padding_ratio <= max_padding
        if not padding_ok:
            verdict = (
                f"rejected: padding over {100 * max_padding:g}% with every grouping "
                f"(up to {LAYER_CHOICES[-1]} layers per group, ends merged or not; the least "
                f"is shown)"
            )
        elif not fits:
            verdict = f"rejected: needs {ours.peak_bytes / _GB:.1f} GB > {budget / _GB:.1f} GB"
        else:
            verdict = "fits"
        candidates.append(
            Candidate(
                shard_ranks=s,
                replicas=world // s,
                layers_per_group=p.layers_per_group,
                merge_ends=p.merge_ends,
                padding_ratio=ours.padding_ratio,
                peak_bytes=ours.peak_bytes,
                step_s=ours.step_s,
                fits=fits,
                padding_ok=padding_ok,
                verdict=verdict,
            )
        )
        projections.append(p)
    ok = [i for i, c in enumerate(candidates) if c.acceptable]
    best = (
        min(
            ok,
            key=lambda i: (
                candidates[i].step_s,
                candidates[i].peak_bytes,
                -candidates[i].shard_ranks,
            ),
        )
        if ok
        else None
    )
    for i, c in enumerate(candidates):
        if i == best:
            candidates[i] = attrs.evolve(c, verdict="chosen: the fastest projected step that fits")
        elif c.acceptable and best is not None:
            slower = c.step_s / candidates[best].step_s - 1
            candidates[i] = attrs.evolve(c, verdict=f"fits, {100 * slower:.1f}% slower")
    return Advice(
        model=model.name,
        world=world,
        gpu=gpu,
        setup=setup,
        budget_bytes=budget,
        max_padding=max_padding,
        candidates=tuple(candidates),
        chosen=None if best is None else candidates[best],
        projection=None if best is None else projections[best],
    )
