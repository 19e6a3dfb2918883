"""Which parameters got a gradient: the same ``.grad`` presence on every rank, by construction.

[Note: gradient presence]
Every trainable parameter is reduced (zeros where a rank did not use it: [Note: conditional
compute] in reduce.py), so values are right whatever each rank's data did, and by default every
trainable parameter of a reduced group keeps a ``.grad``: the same presence on every rank by
construction (FSDP2's ``set_reduce_scatter_unused_params(True)``). A parameter no rank used then
has a zero gradient where one process would have none. With
``set_reduce_scatter_unused_params(False)`` the engine tells the two apart like DDP's
``find_unused_parameters``: each rank notes, on the host, which parameters autograd gave a
gradient (a post-accumulate hook on the unsharded parameters, or the compact path's own look),
the ranks' flags are summed by **one** small all-reduce per backward for every such group of a
mesh together, and parameters no rank used lose their ``.grad``.

The flags are host values, so they travel on the host where the process group can: a backend
serving CPU tensors (gloo, or the CPU part of ``"cpu:gloo,cuda:nccl"``, what
``init_process_group()`` gives on a GPU host) sums them without touching the device; otherwise
they go through the accelerator with one pinned host-to-device copy and one copy back per
backward, for all groups together (never per group).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_engine._private import compat

__all__ = ["Presence", "PresenceOwner", "resolve_presence"]


class Presence:
    """A group's presence flags ([Note: gradient presence]); idle unless ``exact``."""

    def __init__(self, count: int) -> None:
        self.exact = False
        self.used = [False] * count
        self.due: list[bool] | None = None  # after a reduction: which had a .grad before

    def reset(self) -> None:
        self.used = [False] * len(self.used)

    def note_used(self, used: Sequence[bool]) -> None:
        self.used = [a or b for a, b in zip(self.used, used, strict=True)]

    def after_reduction(self, had_grad: Sequence[bool]) -> None:
        if self.exact:
            self.due = list(had_grad)

    def flags(self) -> list[bool] | None:
        """This rank's flags (used, or already had a ``.grad``), None when none are due."""
        if self.due is None:
            return None
        return [u or h for u, h in zip(self.used, self.due, strict=True)]

    def apply(self, used_anywhere: Sequence[bool], sharded: Sequence[nn.Parameter]) -> None:
        self.due = None
        for param, flag in zip(sharded, used_anywhere, strict=True):
            if not flag:
                param.grad = None


def _sum_over_mesh(flags: list[bool], mesh: DeviceMesh, device: torch.device) -> list[bool]:
    """The flags OR-ed over every rank of ``mesh``: one all-reduce per mesh axis."""
    groups = [mesh.get_group(axis) for axis in range(mesh.ndim) if mesh.size(axis) > 1]
    on_host = all(compat.has_backend_for(g, torch.device("cpu")) for g in groups)
    values = torch.tensor(flags, dtype=torch.int32)
    if not on_host:
        pinned = values.pin_memory() if device.type == "cuda" else values
        values = pinned.to(device, non_blocking=True)
    for group in groups:
        dist.all_reduce(values, group=group)
    if not on_host:
        values = values.cpu()  # the one device-to-host read of a backward
    return [bool(v) for v in values.tolist()]


class PresenceOwner(Protocol):
    """A group, as presence sees it."""

    presence: Presence
    mesh: DeviceMesh

    @property
    def device(self) -> torch.device: ...

    def apply_presence(self, used_anywhere: Sequence[bool]) -> None: ...


def resolve_presence(owners: Sequence[PresenceOwner]) -> None:
    """Every due group's flags summed over its mesh, one all-reduce per mesh (per axis), in a
    fixed order; every rank takes part: a group's presence is due on every rank or none (it
    follows its reduction, which every rank issues)."""
    by_mesh: dict[int, list[tuple[PresenceOwner, list[bool]]]] = {}
    for owner in owners:
        flags = owner.presence.flags()
        if flags is not None:
            by_mesh.setdefault(id(owner.mesh), []).append((owner, flags))
    for due in by_mesh.values():
        first = due[0][0]
        total = _sum_over_mesh([f for _, flags in due for f in flags], first.mesh, first.device)
        offset = 0
        for owner, flags in due:
            owner.apply_presence(total[offset : offset + len(flags)])
            offset += len(flags)
