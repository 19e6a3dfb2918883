"""Run-time misuses FSDP2 leaves silent, named: ranks running different numbers of microbatches
(in the collective debug mode) and a non-finite gradient (opt-in).

[Note: microbatch agreement]
Ranks that run different numbers of no-sync microbatches per optimizer step (one rank turns
``set_requires_gradient_sync(True)`` back on a microbatch earlier) issue different collectives:
the first rank's reduce-scatters meet the other's all-gathers, and gloo waits for its timeout
(30 minutes) or aborts, NCCL the same or forever (FSDP2 too). With the parameters kept
unsharded through the window (``reshard_after_forward=False``, ``set_reshard_after_backward(
False)``) no collective runs in a no-sync microbatch at all, so the reduce-scatters pair up and
one rank's gradient silently sums more microbatches than the other's.

In the collective debug mode (``ragged_dtensor.collective_checks()`` or
``RAGGED_DTENSOR_DEBUG_COLLECTIVES=1``) the root checks, at the start of each forward and of
each backward, that every rank is at the same microbatch of its accumulation window with the
same ``requires_gradient_sync``: one agreement check (``ragged_dtensor.check_ranks_agree``, a
32-byte all-gather per mesh axis), itself under the debug mode's bounded store check. A rank
ending its window early is named with the microbatch number on every rank, before any
collective of that microbatch runs. The window's microbatch count is kept on every path (one
integer add per forward); the check costs nothing unless the debug mode is on. It is not on by
default: its all-gathers per microbatch are a measurable cost at small steps, and the issue
asked for a default check only if it costs nothing measurable.

[Note: a non-finite gradient, named]
A NaN or inf gradient on one rank is averaged into every rank's shard by the reduce-scatter
and every rank steps on it (FSDP2 too); ``clip_grad_norm_(error_if_nonfinite=True)`` sees the
reduced norm and cannot tell which rank or parameter it came from. With
``set_check_finite_gradients(True)`` each group computes the norm of its reduce-scatter input
(this rank's whole contribution, after the no-sync window) right before issuing the
reduction, on the device, with no host read; at the end of a backward that reduced, the root
sums a (ranks x groups) table of these norms over the mesh (one all-reduce per mesh axis) and
reads it on the host once. A non-finite entry raises ``NonFiniteGradientError`` from
``backward()`` on every rank, naming the rank(s) and group(s) where it arose and the first
parameter (in the root's order) whose reduced gradient is non-finite: the reduction spread the
non-finite value to exactly those elements, so after waiting for the reductions each rank
flags the parameters with a non-finite element in its own shards (on the failure path only),
one more all-reduce sums the flags, and the first flagged parameter in the root module's
``named_parameters()`` order is named (with the count and the others' names).
The engine is left ready for the next step; the gradients are not cleared (``zero_grad()``
and skip the step, or stop). Cost when on: one norm kernel per group reduction and one small
all-reduce plus one host read per backward; nothing when off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_engine._private import compat
from ragged_dtensor import CollectiveMismatchError, check_ranks_agree, collective_checks_enabled

if TYPE_CHECKING:
    from fsdp_engine._private.param_group import ParamGroup
    from fsdp_engine._private.state import FSDPState

__all__ = ["NonFiniteGradientError", "check_microbatch_agreement", "check_finite_gradients"]


class NonFiniteGradientError(FloatingPointError):
    """``set_check_finite_gradients(True)``: a rank's gradient norm before the reduction was not
    finite (the message names the rank(s), the module(s) and the first parameter)."""


def _mesh_of(states: Sequence[FSDPState]) -> DeviceMesh | None:
    for state in states:
        for group in state.groups:
            return group.mesh
    return None


def check_microbatch_agreement(root: FSDPState, phase: str) -> None:
    """[Note: microbatch agreement]: in the collective debug mode, every rank must be at the
    same microbatch of its window with the same ``requires_gradient_sync`` at the start of
    ``phase`` ("forward" or "backward")."""
    if not collective_checks_enabled():
        return
    mesh = _mesh_of(root.ctx.all_states or [root])
    if mesh is None:
        return
    ctx = root.ctx
    sync = root.config.requires_gradient_sync
    record = {
        "microbatch of the accumulation window": str(ctx.microbatch),
        "requires_gradient_sync": str(sync),
    }
    check_ranks_agree(
        mesh,
        record,
        what=(
            f"fsdp_engine: the ranks run different numbers of microbatches per gradient "
            f"synchronization (at the start of the {phase} of microbatch {ctx.microbatch} of "
            f"accumulation window {ctx.windows + 1} on this rank): a rank with "
            f"requires_gradient_sync=True reduces its gradients now, one with False goes on "
            f"accumulating, and their collectives no longer pair (a hang, or gradients summing "
            f"different numbers of microbatches). Every rank must call "
            f"set_requires_gradient_sync with the same value before the same microbatch "
            f"(checked by the collective debug mode):"
        ),
        error=CollectiveMismatchError,
    )


def _sum_over_mesh(table: torch.Tensor, mesh: DeviceMesh) -> list[list[float]]:
    """``table`` summed over every rank of ``mesh`` (one all-reduce per axis), on the host."""
    groups = [mesh.get_group(axis) for axis in range(mesh.ndim) if mesh.size(axis) > 1]
    if not all(compat.has_backend_for(g, table.device) for g in groups):
        table = table.cpu()
    for group in groups:
        dist.all_reduce(table, group=group)
    values: list[list[float]] = table.cpu().tolist()
    return values


def check_finite_gradients(states: Sequence[FSDPState], root: FSDPState) -> None:
    """[Note: a non-finite gradient, named]: at the end of a backward, raise
    ``NonFiniteGradientError`` on every rank if a checked group's norm before its reduction was
    not finite on some rank."""
    checked: list[tuple[FSDPState, ParamGroup, torch.Tensor]] = []
    for state in states:
        for group in state.groups:
            norm, group.reducer.local_norm = group.reducer.local_norm, None
            if norm is not None:
                checked.append((state, group, norm))
    by_mesh: dict[int, list[tuple[FSDPState, ParamGroup, torch.Tensor]]] = {}
    for entry in checked:
        by_mesh.setdefault(id(entry[1].mesh), []).append(entry)
    for entries in by_mesh.values():
        _check_mesh(entries, root)


def _check_mesh(entries: list[tuple[FSDPState, ParamGroup, torch.Tensor]], root: FSDPState) -> None:
    mesh = entries[0][1].mesh
    world, rank = dist.get_world_size(), dist.get_rank()
    norms = torch.stack([norm for _, _, norm in entries])
    table = torch.zeros(world, len(entries), dtype=torch.float32, device=norms.device)
    table[rank] = norms
    values = _sum_over_mesh(table, mesh)
    bad = [
        (r, j, v) for r, row in enumerate(values) for j, v in enumerate(row) if not math.isfinite(v)
    ]
    if not bad:
        return
    ranks = sorted({r for r, _, _ in bad})
    where = "; ".join(
        f"rank {r}: norm {v} in {_label(entries[j][0], entries[j][1])}" for r, j, v in bad
    )
    first = _first_nonfinite_parameter([g for _, g, _ in entries], mesh, root)
    raise NonFiniteGradientError(
        f"fsdp_engine: non-finite gradient norm before the reduction on rank"
        f"{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} ({where}); the "
        f"reduction averaged it into every rank's gradients. First parameter with a "
        f"non-finite gradient: {first}. Raised on every rank by set_check_finite_gradients; "
        f"the gradients are kept: call zero_grad() and skip this step, or stop"
    )


def _label(state: FSDPState, group: ParamGroup) -> str:
    names = ", ".join(type(m).__name__ for m in state.modules)
    where = f"the fully_shard module {state.fqn!r} ({names})" if state.fqn else names
    if len(state.groups) > 1:
        where += f", its {group.dtype} group"
    return where


def _first_nonfinite_parameter(
    groups: Sequence[ParamGroup], mesh: DeviceMesh, root: FSDPState
) -> str:
    """Failure path: the first parameter, in the root module's ``named_parameters()`` order,
    whose reduced gradient is non-finite on some rank of ``mesh``, by name, and how many are
    (or why none is). One flag per parameter, summed over the mesh: a parameter is named only
    if some rank saw a non-finite element of its gradient."""
    for group in groups:
        group.wait_for_reduce()
    order = {id(p): i for i, (_, p) in enumerate(root.module.named_parameters())}
    names = {id(p): n for n, p in root.module.named_parameters(remove_duplicate=False)}
    params = sorted(
        (p for g in groups for p in g.params),
        key=lambda p: order.get(id(p.sharded), len(order)),  # stable: then the groups' order
    )
    flags = torch.zeros(len(params), dtype=torch.float32)
    for index, param in enumerate(params):
        grad = param.sharded.grad
        if grad is None:
            continue
        local = compat.local_tensor(grad) if isinstance(grad, DTensor) else grad
        if local.numel() and not bool(torch.isfinite(local).all()):
            flags[index] = 1.0
    summed = _sum_over_mesh(flags[None], mesh)[0] if params else []
    bad = [names.get(id(p.sharded), p.fqn) for p, f in zip(params, summed, strict=True) if f > 0]
    if not bad:
        return "none (the norm overflowed; every element is finite)"
    more = f" ({len(bad)} in all: {', '.join(map(repr, bad[:8]))}{', ...' if len(bad) > 8 else ''})"
    return repr(bad[0]) + (more if len(bad) > 1 else "")
