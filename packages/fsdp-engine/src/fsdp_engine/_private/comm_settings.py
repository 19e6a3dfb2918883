"""What ``FSDPModule``'s communication setters do to a call's groups: FSDP2's validation of the
staging-buffer settings the engine accepts without effect, and the separate reduce-scatter
process groups (``set_separate_reduce_scatter_group``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

if TYPE_CHECKING:
    from fsdp_engine._private.param_group import ParamGroup

__all__ = [
    "check_no_custom_comm_for_allocation",
    "check_symm_mem_for_comm",
    "configure_separate_reduce_scatter_groups",
]


def check_no_custom_comm_for_allocation(groups: Sequence[ParamGroup]) -> None:
    """FSDP2's check of ``set_allocate_memory_from_process_group_for_comm``: not with a custom
    collective."""
    for group in groups:
        if group.config.all_gather_comm is not None or group.config.reduce.comm is not None:
            raise AssertionError(
                "set_allocate_memory_from_process_group_for_comm cannot be used together "
                "with set_custom_all_gather / set_custom_reduce_scatter"
            )


def check_symm_mem_for_comm(groups: Sequence[ParamGroup], backend: str) -> None:
    """FSDP2's checks of ``set_symm_mem_for_comm``: the ``"NCCL"`` backend, no custom
    collective (FSDP2's messages)."""
    if backend != "NCCL":
        raise ValueError(f'set_symm_mem_for_comm: backend must be "NCCL", got {backend!r}')
    for group in groups:
        for kind, comm in (
            ("all gather", group.config.all_gather_comm),
            ("reduce scatter", group.config.reduce.comm),
        ):
            if comm is not None:
                raise AssertionError(
                    f"cannot call set_symm_mem() when {kind} comm is custom: {type(comm).__name__}"
                )


def configure_separate_reduce_scatter_groups(groups: Sequence[ParamGroup], enable: bool) -> None:
    """``enable``: each group reduce-scatters on a process group of its own over its shard ranks
    (``dist.new_group(..., use_local_synchronization=True)``, one per distinct set of shard
    ranks, a group's existing one reused); otherwise back to the mesh's group. Collective over
    the shard ranks, as in FSDP2."""
    new_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for group in groups:
        separate = None
        if enable:
            shard_group = group.mesh.get_group(group.storage.shard_axis)
            ranks = tuple(dist.get_process_group_ranks(shard_group))
            if ranks not in new_groups:
                existing = group.config.separate_rs_group
                new_groups[ranks] = existing or dist.new_group(
                    list(ranks), use_local_synchronization=True
                )
            separate = new_groups[ranks]
        group.configure(separate_rs_group=separate)
