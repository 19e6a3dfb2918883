"""Projected per-rank peak memory of a training step (one engine's memory timeline).

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
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from shard_planner.projection._private.activations import (
    activation_bytes,
    attention_part,
    backward_work_bytes,
    fused_gradient_bytes,
    second_half_numel,
)
from shard_planner.projection._private.setup import OPTIMIZERS, GroupLayout, Setup

__all__ = ["KINDS", "peak", "slots"]


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


def slots(groups: Sequence[GroupLayout], setup: Setup, engine: str) -> list[_Slot]:
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


KINDS = (
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


def peak(slots: Sequence[_Slot], setup: Setup, engine: str) -> tuple[int, str, dict[str, float]]:
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
