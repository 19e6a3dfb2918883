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

The flags are host values, so they always travel on the host, never through the device (a
device round trip would be one host sync per backward): on the mesh's own group when its
backend serves CPU tensors (gloo, or the CPU part of ``"cpu:gloo,cuda:nccl"``, what
``init_process_group()`` gives on a GPU host); on an accelerator-only group (NCCL alone), on a
gloo group over the same ranks, made once per group the first time it is needed (every rank of
the group gets there at the same point: the presence is resolved in a fixed order).
"""

from __future__ import annotations

import weakref
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


_HOST_GROUPS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)


def _on_host(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """``group`` itself if its backend serves CPU tensors, else a gloo group over its ranks."""
    if compat.has_backend_for(group, torch.device("cpu")):
        return group
    host = _HOST_GROUPS.get(group)
    if host is None:
        ranks = dist.get_process_group_ranks(group)
        made = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
        assert made is not None  # this rank is one of ``ranks``
        host = _HOST_GROUPS[group] = made
    return host


def _sum_over_mesh(flags: list[bool], mesh: DeviceMesh) -> list[bool]:
    """The flags OR-ed over every rank of ``mesh``: one all-reduce per mesh axis, on the host."""
    values = torch.tensor(flags, dtype=torch.int32)
    for axis in range(mesh.ndim):
        if mesh.size(axis) > 1:
            dist.all_reduce(values, group=_on_host(mesh.get_group(axis)))
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
        total = _sum_over_mesh([f for _, flags in due for f in flags], first.mesh)
        offset = 0
        for owner, flags in due:
            owner.apply_presence(total[offset : offset + len(flags)])
            offset += len(flags)
