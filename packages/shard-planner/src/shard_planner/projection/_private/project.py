"""Projected per-rank peak memory and step time of a training step, ours vs FSDP2.

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

[Note: the memory timeline]
Bytes live on one rank are summed at every point where the schedule changes what is live, and
the peak is the largest sum (``_peak``). Always live: sharded parameters and optimizer states.
Forward of group ``i``: the activations kept by the groups before it (``activations`` Note) and
its own, its gathered parameters, and those of the ``forward_prefetch`` groups after it (ours: their
unsharded storage, FSDP2: one all-gather output kept until the next all-gather, as FSDP2's
``AllGatherState`` does). Backward of group ``j``: activations of the groups up to ``j``, the
backward working set, its gathered parameters, the ``backward_prefetch`` groups before it
gathered, the previous group's reduction still in flight (ours: its gradient storage, the
reduce-scatter input, written in the reduce dtype; FSDP2: its reduce-scatter input, kept until
the next reduce-scatter) and the sharded gradients of every group already reduced. After the
backward of ``j`` (its activations freed; both engines reshard first): its reduction's buffers
replace the previous one's, with autograd's unsharded gradients whole (they appear one by one
during the backward as autograd frees the activations that made them, and both engines hold them
to the group's post-backward, so they are counted here). Late in the backward of ``j``, while
the attention half of its first layer runs: the gradients of everything else in the group exist
(the MLP or experts' first of all), only that half's activations remain, and the last fused
expert gradient is being stacked from its per-expert pieces (both alive). Optimizer
step: shards, states, gradients and one shard-size temporary (torch's foreach AdamW computes the
square root of the second moment out of place). Mixed precision: parameters and their shards in
``param_bytes``, gathered parameters, activations and unsharded gradients in ``compute_bytes``, the
reduction in ``reduce_bytes``, sharded gradients in ``param_bytes``.

[Note: the step time]
Compute per group: its forward FLOPs (``activations.forward_flops``) for the micro-batch's
tokens, backward twice that (plus one more forward with activation checkpointing), at ``mfu``
of the GPU's dense BF16 peak. Collectives by the alpha-beta model of ``hardware``: all-gather of
each group in forward and again in backward (parameters are resharded after forward), one
reduce-scatter per group, with HSDP one all-reduce of the shard over the replicas. Two
resources, compute and the network, overlap as the schedule allows: in forward the all-gather
of group ``i + 1`` runs under the compute of group ``i`` (with ``forward_prefetch >= 1``; with
0 it is exposed), in backward the all-gather of ``j - 1`` and the reduction of ``j + 1`` share the
network under the compute of ``j``; the first all-gather and the last reduction are exposed.
Copies run at HBM bandwidth (bytes read plus bytes written): FSDP2's copy-out on the compute
stream, its all-gather and reduce-scatter copy-ins on the communication streams; our
mixed-precision casts (the shard to the compute dtype before the all-gather, the unsharded
gradients to the reduce dtype) on the compute stream. The optimizer step is memory bound:
AdamW reads and writes parameters and both moments and reads the gradients.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from shard_planner import TensorSpec, plan
from shard_planner.projection._private.activations import (
    activation_bytes,
    attention_part,
    backward_work_bytes,
    forward_flops,
    fused_gradient_bytes,
    second_half_numel,
)
from shard_planner.projection._private.catalogue import Group, Model, Weight
from shard_planner.projection._private.hardware import NETWORKS, Gpu, Network, collective_seconds

__all__ = [
    "OPTIMIZERS",
    "EngineProjection",
    "GroupLayout",
    "Projection",
    "Setup",
    "project",
]

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


@attrs.frozen
class EngineProjection:
    """The projection for one engine (``"ours"`` or ``"fsdp2"``)."""

    engine: str
    peak_bytes: int
    peak_at: str  # the point of the step where the peak occurs
    breakdown: tuple[tuple[str, int], ...]  # bytes by kind at the peak
    padding_ratio: float  # (buffer - parameters) / parameters over the whole model
    step_s: float
    compute_s: float
    all_gather_s: float  # sum over the step (not only the exposed part)
    reduce_s: float  # reduce-scatters plus HSDP all-reduces
    copy_s: float
    optimizer_s: float
    groups: tuple[GroupLayout, ...]

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s - self.optimizer_s)

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_bytes <= budget_bytes


@attrs.frozen
class Projection:
    model: str
    world: int
    shard_ranks: int
    layers_per_group: int
    merge_ends: bool
    gpu: Gpu
    setup: Setup
    ours: EngineProjection
    fsdp2: EngineProjection

    @property
    def replicas(self) -> int:
        return self.world // self.shard_ranks


@attrs.frozen
class _Slot:
    """Bytes of one group instance of the schedule (one position in forward order)."""

    name: str
    gathered: float  # unsharded parameters
    gather_extra: float  # kept beside them by the all-gather (FSDP2's output; our cast shard)
    unsharded_grads: float
    reduce_buffers: float  # what a reduction in flight holds beyond the unsharded gradients
    grads: float  # sharded gradients
    shard: float  # sharded parameters
    state: float  # optimizer state
    activations: float  # kept for backward, whole forward until this group's backward
    activations_live: float  # the full activations while this group computes
    work: float  # backward working set
    numel: int
    # while the attention half of the group's first layer runs backward ([Note: the memory
    # timeline]): autograd's gradients made so far, the activations still kept, the working set
    late_grads: float
    late_activations: float
    late_work: float


def _slots(groups: Sequence[GroupLayout], setup: Setup, engine: str) -> list[_Slot]:
    pb, cb, rb = setup.param_bytes, setup.compute_bytes, setup.reduce_bytes
    state_bytes = OPTIMIZERS[setup.optimizer][0]
    tokens = setup.tokens
    slots = []
    for g in groups:
        ac = setup.activation_checkpointing
        full = sum(activation_bytes(p, cb) * n for p, n in g.parts) * tokens
        kept = sum(activation_bytes(p, cb, checkpointing=ac) * n for p, n in g.parts) * tokens
        work = max(backward_work_bytes(p, cb) for p, _ in g.parts) * tokens + sum(
            fused_gradient_bytes(p, cb) * n for p, n in g.parts
        )
        if engine == "ours":
            gather_extra = 0  # the cast shard is written into the output's slot (no temporary)
            unsharded = g.numel * cb  # autograd's gradients, held to the group's post-backward
            # the reduce-scatter input is the group's gradient storage, written in the reduce
            # dtype at once; its output is the gradient shard unless that dtype differs
            reduce = g.gathered * rb + (g.shard * rb if rb != pb else 0)
        else:
            gather_extra = g.gathered * cb + g.shard * cb  # all-gather output and copy-in
            unsharded = g.numel * cb  # autograd's gradients of the unpadded parameters
            reduce = g.gathered * rb + g.shard * rb  # reduce-scatter input and output
        # the group's first decoder layer (in forward) runs backward last: every other copy's
        # gradients and its own MLP half's exist, only its attention half's activations remain
        layer_parts = [(p, n) for p, n in g.parts if attention_part(p, cb) != (0, 0)]
        late = (0.0, 0.0, 0.0)
        if layer_parts:
            first = layer_parts[0][0]
            acts, late_work = attention_part(first, cb)
            first_attention = first.numel - second_half_numel(first)
            # a fused 3-D expert tensor's gradient is stacked from its per-expert pieces when
            # its last piece is made, at the end of the MLP half: both alive then (the first
            # layer's first fused tensor in forward is the last stacked)
            fused = [w.numel for w in first.weights if w.matrix and len(w.shape) == 3]
            stack = fused[0] * cb if fused else 0
            late = ((g.numel - first_attention) * cb, acts * tokens, late_work * tokens + stack)
        for _ in range(g.count):
            slots.append(
                _Slot(
                    g.name,
                    gathered=g.gathered * cb,
                    gather_extra=gather_extra,
                    unsharded_grads=unsharded,
                    reduce_buffers=reduce,
                    grads=g.shard * pb,
                    shard=g.shard * pb,
                    state=g.shard * state_bytes,
                    activations=kept,
                    activations_live=full,
                    work=work,
                    numel=g.numel,
                    late_grads=late[0],
                    late_activations=late[1],
                    late_work=late[2],
                )
            )
    return slots


_KINDS = (
    "parameter shards",
    "optimizer state",
    "gradient shards",
    "gathered parameters",
    "unsharded gradients",
    "reduce buffers",
    "activations",
    "backward working set",
    "optimizer temporaries",
)


def _peak(slots: Sequence[_Slot], setup: Setup, engine: str) -> tuple[int, str, dict[str, float]]:
    """The largest live sum over the schedule (module Note), where, and its breakdown."""
    d, e = setup.forward_prefetch, setup.backward_prefetch
    n = len(slots)
    base = {
        "parameter shards": sum(s.shard for s in slots),
        "optimizer state": sum(s.state for s in slots),
    }
    kept_before = [0.0]
    for s in slots:
        kept_before.append(kept_before[-1] + s.activations)
    points: list[tuple[str, dict[str, float]]] = []

    def ahead(indices: range) -> float:
        """Gathered bytes of groups prefetched at ``indices``."""
        live = [i for i in indices if 0 <= i < n]
        if engine == "ours":
            return sum(slots[i].gathered + slots[i].gather_extra for i in live)
        # FSDP2 keeps one all-gather output beyond the current unsharded parameters
        return slots[live[0]].gather_extra if live else 0.0

    for i, s in enumerate(slots):
        acts = kept_before[i] + s.activations_live
        if engine == "ours":
            gathered = {"": s.gathered + ahead(range(i + 1, i + 1 + d))}
        else:
            # FSDP2 keeps a group's all-gather output until the next group's copy-out: at the
            # copy-out of ``i`` the previous output is still live (on an accelerator the next
            # one, issued ahead, is instead), and while ``i`` computes its own output is, with
            # the prefetched next one
            other = slots[i + 1] if d and i + 1 < n else slots[i - 1] if i else None
            ahead_extra = slots[i + 1].gather_extra if d and i + 1 < n else 0.0
            gathered = {
                "copy-out": s.gathered + s.gather_extra + (other.gather_extra if other else 0.0),
                "": s.gathered + s.gather_extra + ahead_extra,
            }
        for phase, live in gathered.items():
            points.append(
                (
                    f"forward of {s.name} (group {i}){', ' + phase if phase else ''}",
                    {
                        **base,
                        "gathered parameters": live,
                        "activations": kept_before[i] if phase else acts,
                    },
                )
            )
    grads_after = 0.0
    for j in range(n - 1, -1, -1):
        s = slots[j]
        prefetched = ahead(range(j - 1, j - 1 - e, -1)) if e else 0.0
        inflight_reduce = 0.0
        if j + 1 < n:
            nxt = slots[j + 1]
            inflight_reduce = nxt.reduce_buffers
        if engine == "fsdp2":
            # the copy-out of this group's parameters (its all-gather output freed right
            # after), before its backward starts and before it prefetches the next one
            points.append(
                (
                    f"backward of {s.name} (group {j}), copy-out",
                    {
                        **base,
                        "gradient shards": grads_after,
                        "gathered parameters": s.gathered + s.gather_extra,
                        "reduce buffers": inflight_reduce,
                        "activations": kept_before[j + 1],
                    },
                )
            )
        # autograd's gradients appear one by one as it frees the activations that made them
        # (counted whole at the reduction below); both engines hold them to post-backward
        points.append(
            (
                f"backward of {s.name} (group {j})",
                {
                    **base,
                    "gradient shards": grads_after,
                    "gathered parameters": s.gathered + prefetched,
                    "reduce buffers": inflight_reduce,
                    "activations": kept_before[j] + s.activations_live,
                    "backward working set": s.work,
                },
            )
        )
        if s.late_grads:
            points.append(
                (
                    f"backward of {s.name} (group {j}), its first attention",
                    {
                        **base,
                        "gradient shards": grads_after,
                        "gathered parameters": s.gathered + prefetched,
                        "unsharded gradients": s.late_grads,
                        "reduce buffers": inflight_reduce,
                        "activations": kept_before[j] + s.late_activations,
                        "backward working set": s.late_work,
                    },
                )
            )
        grads_after += s.grads
        # both engines reshard before they reduce: the reduction's buffers come after the
        # group's gathered parameters have gone
        points.append(
            (
                f"reduction of {s.name} (group {j})",
                {
                    **base,
                    "gradient shards": grads_after,
                    "gathered parameters": prefetched,
                    "unsharded gradients": s.unsharded_grads,
                    "reduce buffers": s.reduce_buffers,
                    "activations": kept_before[j],
                },
            )
        )
    temp = base["parameter shards"] if OPTIMIZERS[setup.optimizer][1] else 0.0
    points.append(
        (
            "optimizer step",
            {**base, "gradient shards": grads_after, "optimizer temporaries": temp},
        )
    )
    where, parts = max(points, key=lambda p: sum(p[1].values()))
    return round(sum(parts.values())), where, parts


def _times(
    groups: Sequence[GroupLayout],
    setup: Setup,
    engine: str,
    *,
    shard_ranks: int,
    replicas: int,
    gpu: Gpu,
    network: Network,
) -> dict[str, float]:
    pb, cb, rb = setup.param_bytes, setup.compute_bytes, setup.reduce_bytes
    rate = gpu.bf16_flops * setup.mfu
    intra = shard_ranks <= gpu.gpus_per_node
    hbm = gpu.hbm_bytes_per_s
    fwd: list[float] = []
    ag: list[float] = []
    red: list[float] = []
    gather_copy: list[float] = []  # per all-gather, on the compute stream
    reduce_copy: list[float] = []  # per reduction, on the compute stream
    ag_copy_in: list[float] = []  # per all-gather, on a communication stream
    rs_copy_in: list[float] = []  # per reduction, on a communication stream
    for g in groups:
        flops = sum(forward_flops(p, setup.seq) * n for p, n in g.parts) * setup.tokens
        a = collective_seconds(
            "all_gather", shard_ranks, g.shard * cb, intra_node=intra, gpu=gpu, network=network
        )
        r = collective_seconds(
            "reduce_scatter",
            shard_ranks,
            g.shard * rb,
            intra_node=intra,
            gpu=gpu,
            network=network,
        )
        r += collective_seconds(
            "all_reduce",
            replicas,
            g.shard * rb,
            intra_node=replicas * shard_ranks <= gpu.gpus_per_node,
            gpu=gpu,
            network=network,
        )
        if engine == "ours":
            per_gather = g.shard * (pb + cb) / hbm if cb != pb else 0.0  # cast of the shard
            per_reduce = g.gathered * (cb + rb) / hbm if rb != cb else 0.0  # cast of grads
            cin_ag = cin_rs = 0.0
        else:
            per_gather = 2 * g.gathered * cb / hbm  # copy-out: read the output, write params
            per_reduce = 0.0
            cin_ag = g.shard * (pb + cb) / hbm  # copy-in (and cast) of the shards
            cin_rs = (g.numel * cb + g.gathered * rb) / hbm  # gradients into the RS input
        for _ in range(g.count):
            fwd.append(flops / rate)
            ag.append(a)
            red.append(r)
            gather_copy.append(per_gather)
            reduce_copy.append(per_reduce)
            ag_copy_in.append(cin_ag)
            rs_copy_in.append(cin_rs)
    n = len(fwd)
    recompute = 1.0 if setup.activation_checkpointing else 0.0
    d, e = setup.forward_prefetch, setup.backward_prefetch
    # forward: group i computes while the all-gather of i + 1 runs (prefetch), else serial
    forward = ag[0] + ag_copy_in[0]
    for i in range(n):
        nxt = ag[i + 1] + ag_copy_in[i + 1] if i + 1 < n else 0.0
        work = fwd[i] + gather_copy[i]
        forward += max(work, nxt) if d else work + nxt
    # backward: group j computes while the all-gather of j - 1 and the reduction of j + 1 share
    # the network
    backward = ag[n - 1] + ag_copy_in[n - 1]
    for j in range(n - 1, -1, -1):
        comm = red[j + 1] + rs_copy_in[j + 1] if j + 1 < n else 0.0
        gather = ag[j - 1] + ag_copy_in[j - 1] if j >= 1 else 0.0
        work = (2.0 + recompute) * fwd[j] + gather_copy[j] + reduce_copy[j]
        backward += max(work, comm + gather) if e else max(work, comm) + gather
    backward += red[0] + rs_copy_in[0]
    state_bytes = OPTIMIZERS[setup.optimizer][0]
    shard = sum(g.shard * g.count for g in groups)
    optimizer = shard * (3 * pb + 2 * state_bytes) / hbm
    compute = sum(fwd) * (3.0 + recompute)
    return {
        "step": forward + backward + optimizer,
        "compute": compute,
        "all_gather": 2 * sum(ag),
        "reduce": sum(red),
        "copy": 2 * sum(gather_copy) + sum(reduce_copy) + 2 * sum(ag_copy_in) + sum(rs_copy_in),
        "optimizer": optimizer,
    }


def _engine(
    model: Model,
    shard_ranks: int,
    replicas: int,
    layers_per_group: int,
    gpu: Gpu,
    setup: Setup,
    engine: str,
    merge_ends: bool,
) -> EngineProjection:
    groups = layouts(model, shard_ranks, layers_per_group, setup, engine, merge_ends=merge_ends)
    slots = _slots(groups, setup, engine)
    peak, where, parts = _peak(slots, setup, engine)
    times = _times(
        groups,
        setup,
        engine,
        shard_ranks=shard_ranks,
        replicas=replicas,
        gpu=gpu,
        network=NETWORKS[setup.network],
    )
    numel = sum(g.numel * g.count for g in groups)
    padding = sum(g.padding * g.count for g in groups)
    return EngineProjection(
        engine=engine,
        peak_bytes=peak,
        peak_at=where,
        breakdown=tuple((k, round(parts.get(k, 0.0))) for k in _KINDS),
        padding_ratio=padding / numel if numel else 0.0,
        step_s=times["step"],
        compute_s=times["compute"],
        all_gather_s=times["all_gather"],
        reduce_s=times["reduce"],
        copy_s=times["copy"],
        optimizer_s=times["optimizer"],
        groups=tuple(groups),
    )


def project(
    model: Model,
    world: int,
    gpu: Gpu,
    setup: Setup = Setup(),
    *,
    shard_ranks: int | None = None,
    layers_per_group: int = 1,
    merge_ends: bool = False,
) -> Projection:
    """Project one training step of ``model`` on ``world`` ranks of ``gpu`` (module Notes).

    ``shard_ranks``: the shard-group size (HSDP: ``world / shard_ranks`` replicas; default
    ``world``, plain FSDP). ``layers_per_group``: decoder layers per ``fully_shard`` group.
    ``merge_ends``: the embedding shares the first layer group, the head the last one.
    """
    shard = world if shard_ranks is None else shard_ranks
    if world < 1 or shard < 1 or world % shard:
        raise ValueError(
            f"shard_ranks {shard} must be a positive divisor of the world size {world}"
        )
    replicas = world // shard
    args = (model, shard, replicas, layers_per_group, gpu, setup)
    ours = _engine(*args, "ours", merge_ends)
    fsdp2 = _engine(*args, "fsdp2", merge_ends)
    return Projection(
        model.name, world, shard, layers_per_group, merge_ends, gpu, setup, ours, fsdp2
    )
