"""Projected per-rank peak memory and step time of a training step, ours vs FSDP2.

The setup and the layouts are in ``setup``, the memory timeline in ``memory``; this module
projects the step time and puts one projection together.

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

from collections.abc import Sequence

import attrs

from shard_planner.projection._private.activations import forward_flops
from shard_planner.projection._private.catalogue import Model
from shard_planner.projection._private.hardware import NETWORKS, Gpu, Network, collective_seconds
from shard_planner.projection._private.memory import KINDS, peak, slots
from shard_planner.projection._private.setup import OPTIMIZERS, GroupLayout, Setup, layouts

__all__ = [
    "OPTIMIZERS",
    "EngineProjection",
    "GroupLayout",
    "Projection",
    "Setup",
    "project",
]


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
    slot_list = slots(groups, setup, engine)
    peak_bytes, where, parts = peak(slot_list, setup, engine)
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
        peak_bytes=peak_bytes,
        peak_at=where,
        breakdown=tuple((k, round(parts.get(k, 0.0))) for k in KINDS),
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
    setup: Setup = Setup(),  # noqa: B008 - frozen value
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
