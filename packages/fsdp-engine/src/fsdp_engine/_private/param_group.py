"""One dtype's parameters of a ``fully_shard`` call: their lifecycle between sharded and
unsharded (FSDP2's ``FSDPParamGroup``).

[Note: sharded states]
``SHARDED -> UNSHARDED -> SHARDED`` (or ``SHARDED_POST_FORWARD`` after forward with
``reshard_after_forward=k``: a 1/k part of the gathered buffer kept for backward). ``unshard``
starts the all-gather (``async_op``: a prefetch) and ``wait_for_unshard`` completes it and
registers the unsharded parameters; ``reshard`` frees and registers the sharded ones. How the
unsharded storage is filled is the group's ``Gather`` strategy ([Note: all-gather strategies]),
chosen when the group is made, reconfigured (``configure``), converted or materialized, never a
flag tested per call. What the iteration must wait for before the first all-gather (the shards'
last write: the optimizer step) is passed in as ``ready``.

A ``fully_shard`` call whose parameters have several dtypes gets one group per dtype
(``FSDPState.groups``): one collective per dtype, each over a buffer of one dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dbuffer import AllGatherComm, Handle
from fsdp_engine._private.api import BlockPolicy, MixedPrecisionPolicy
from fsdp_engine._private.extension_gather import gather_for_params
from fsdp_engine._private.gather import Gather, PostForwardPart
from fsdp_engine._private.group_layout import lay_out_group
from fsdp_engine._private.group_lifecycle import GroupLifecycle, ShardedState
from fsdp_engine._private.param import (
    ParamRef,
    adopt_registered,
    applied_values,
    check_applied_device,
)
from fsdp_engine._private.plans import alignment, view_dtypes
from fsdp_engine._private.presence import Presence
from fsdp_engine._private.reduce import GradReducer
from fsdp_engine._private.reduce_comm import ReduceSettings, choose_reduce_comm
from fsdp_engine._private.spmd import SpmdMesh
from fsdp_engine._private.storage import group_dtypes

__all__ = ["GroupConfig", "ParamGroup", "ShardedState"]


@attrs.frozen
class GroupConfig:
    """What ``FSDPModule``'s setters configure on a group (``ParamGroup.configure``)."""

    reduce: ReduceSettings = attrs.field(factory=ReduceSettings)
    all_gather_comm: AllGatherComm | None = None
    exact_presence: bool = False  # set_reduce_scatter_unused_params(False)
    max_input_buffers: int = (
        1  # set_reduce_scatter_max_input_buffers ([Note: reductions in flight])
    )
    post_forward_k: int = 0  # reshard_after_forward=k: a 1/k part kept after forward (0: none)
    # set_gradients_in_parameter_storage ([Note: gradients in the parameters' storage])
    gradients_in_place: bool = False
    # set_requires_all_reduce / set_separate_reduce_scatter_group ([Note: reduction strategies])
    requires_all_reduce: bool = True
    # the state's settings the lifecycle needs ([Note: the group's lifecycle])
    requires_gradient_sync: bool = True
    reshard_after_backward: bool = True
    reshard_after_forward: bool = True
    unshard_in_backward: bool = True
    separate_rs_group: dist.ProcessGroup | None = (
        None  # not "reduce_": that prefix is ReduceSettings
    )


class ParamGroup(GroupLifecycle):
    """The parameters of one dtype of one ``fully_shard`` call over one mesh (1-D or 2-D HSDP)."""

    def __init__(
        self,
        refs: Sequence[ParamRef],
        mesh: DeviceMesh,
        *,
        mp_policy: MixedPrecisionPolicy,
        block_policy: BlockPolicy | None,
        shard_axis: int,
        device: torch.device,
        planner: str = "auto",
        shard_dims: Sequence[int] | None = None,
        post_forward_k: int = 0,
        spmd: SpmdMesh | None = None,
    ) -> None:
        self.refs = tuple(refs)
        self.mesh = mesh
        self.mp_policy = mp_policy
        layout = lay_out_group(
            refs,
            mesh,
            mp_policy=mp_policy,
            block_policy=block_policy,
            shard_axis=shard_axis,
            device=device,
            planner=planner,
            shard_dims=shard_dims,
            spmd=spmd,
        )
        self.storage = layout.storage
        self.plan = layout.storage.plan
        self.quantized = layout.quantized
        self.params = list(layout.params)
        self.config = GroupConfig(post_forward_k=post_forward_k)
        self.post_forward_part = (
            PostForwardPart(mesh, post_forward_k, self.storage.rank) if post_forward_k else None
        )
        self.presence = Presence(len(self.params))
        self.state = ShardedState.SHARDED
        self.unshard_handle: Handle | None = None
        self.conversion_incomplete: list[str] | None = None
        # inside ``to_empty``: what ``_apply`` leaves are undefined values, not to be copied
        self.values_undefined = False
        self._set_dtypes()
        for param in self.params:
            param.register_sharded()

    # -- configuration ------------------------------------------------------------------------
    def configure(self, **changes: object) -> None:
        """The one entry for ``FSDPModule``'s setters: ``GroupConfig`` fields, or
        ``reduce_<field>`` for ``ReduceSettings``; the strategies follow."""
        reduce_changes = {
            k[len("reduce_") :]: v for k, v in changes.items() if k.startswith("reduce_")
        }
        other = {k: v for k, v in changes.items() if not k.startswith("reduce_")}
        config = attrs.evolve(self.config, **other)  # type: ignore[arg-type]
        if reduce_changes:
            config = attrs.evolve(config, reduce=attrs.evolve(config.reduce, **reduce_changes))  # type: ignore[arg-type]
        if config.post_forward_k != self.config.post_forward_k:
            if self.state is not ShardedState.SHARDED:
                self.reshard()  # a part kept for the old setting goes
            k = config.post_forward_k
            self.post_forward_part = PostForwardPart(self.mesh, k, self.storage.rank) if k else None
        gather_changed = (
            config.all_gather_comm is not self.config.all_gather_comm
            or config.post_forward_k != self.config.post_forward_k
        )
        reduce_changed = (
            config.requires_all_reduce != self.config.requires_all_reduce
            or config.separate_rs_group is not self.config.separate_rs_group
        )
        self.config = config
        self.presence.exact = config.exact_presence
        if gather_changed:
            self._choose_gather()
        if reduce_changed:
            self._choose_reduce()

    def _set_dtypes(self) -> None:
        """Compute and reduce dtypes from the policy and the parameters' dtype; the gradient
        path and the gather strategy for them."""
        dtype, policy = self.storage.dtype, self.mp_policy
        self.compute_dtype, self.gather_dtype, self.reduce_dtype = group_dtypes(
            dtype, policy, bitcast_dtype=self.storage.buffer.dtype if self.storage.bitcast else None
        )
        aligned = view_dtypes(dtype, policy.param_dtype, policy.reduce_dtype)
        self.reducer = GradReducer(
            self.storage,
            self.params,
            compute_dtype=self.compute_dtype,
            reduce_dtype=self.reduce_dtype,
            align=alignment(aligned),
        )
        self._choose_gather()
        self._choose_reduce()

    def _choose_reduce(self) -> None:
        """[Note: reduction strategies] (reduce_comm.py)."""
        self.reducer.comm = choose_reduce_comm(
            replicated=bool(self.storage.buffer.replicate_axes),
            requires_all_reduce=self.config.requires_all_reduce,
            shard_group=self.config.separate_rs_group,
        )

    def _choose_gather(self) -> None:
        self.gather: Gather = gather_for_params(
            self.storage,
            self.params,
            gather_dtype=self.gather_dtype,
            compute_dtype=self.compute_dtype,
            quantized=self.quantized,
            comm=self.config.all_gather_comm,
            keep_gathered=self.post_forward_part is not None,
            mp_policy=self.mp_policy,
        )
        for param in self.params:
            param.forget_unsharded()

    # -- names and views ----------------------------------------------------------------------
    @property
    def dtype(self) -> torch.dtype:
        return self.storage.dtype

    # -- parameters assigned or converted by the user -----------------------------------------
    def to_sharded(self) -> None:
        """Register the sharded parameters, taking over any the user put in their place."""
        if self.state is ShardedState.SHARDED and self.unshard_handle is None:
            self.adopt_registered()
        self.reshard()

    def adopt_registered(self) -> None:
        """Take over parameters the user registered in place of ours while sharded (FSDP2's
        ``reset_sharded_param``): ``model.w = nn.Parameter(...)``, ``load_state_dict(assign=
        True)``."""
        if self.state is not ShardedState.SHARDED:
            return
        generation = self.storage.generation
        adopted = adopt_registered(self.params)
        if self.storage.generation != generation:  # materialized: a new buffer
            self._set_dtypes()
        elif adopted:
            self._choose_gather()

    def reset_after_apply(self) -> None:
        """After ``nn.Module._apply`` (``.to(dtype)``, ``.float()``, ``to_empty``...): adopt the
        dtype and values the sharded parameters were given, into our (possibly re-typed)
        storage; the wrapper's dtype and device are the truth."""
        currents = applied_values(self.params)
        dtypes = {c.dtype for c in currents}
        if len(dtypes) != 1:
            # a group of several modules is converted module by module: wait for the rest
            self.conversion_incomplete = sorted(map(str, dtypes))
            return
        self.conversion_incomplete = None
        check_applied_device(self.params, currents, self.storage.device)
        new_dtype = dtypes.pop()
        grads = [c.grad for c in currents]
        generation = self.storage.generation
        if new_dtype != self.storage.dtype:
            self.storage.retype(new_dtype)
        for param, current in zip(self.params, currents, strict=True):
            param.adopt_applied(current, copy=not self.values_undefined)
        if self.storage.generation != generation:  # retyped or materialized: a new buffer
            self._set_dtypes()
        else:
            self._choose_gather()
        if any(g is not None for g in grads):
            self.reducer.adopt_grads(grads)

    @property
    def device(self) -> torch.device:
        return self.storage.device
