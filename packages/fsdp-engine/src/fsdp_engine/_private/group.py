"""One ``fully_shard`` call's parameters: planned into one flat buffer, one collective each way.

[Note: plan, then hold]
``ParamGroup`` asks the planner for a layout (each parameter contiguous, no block cut, equal
shards), then holds the parameters in a ``DBuffer``: the module's registered parameters become
``RaggedShard`` DTensor views of the shard storage (what the optimizer updates, in place), and the
parameters used in forward/backward are plain views of the unsharded storage, which one all-gather
fills and ``reshard`` frees. Gradients mirror it: autograd accumulates into views of an unsharded
gradient storage (pre-zeroed once per backward, one kernel), one reduce-scatter writes the sharded
gradient storage whose views are the sharded parameters' ``.grad``. Nothing is copied in or out.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from typing import Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from dbuffer import DBuffer, Handle
from fsdp_engine._private.plans import cached_plan
from fsdp_engine._private.policy import BlockPolicy, MixedPrecisionPolicy
from ragged_dtensor import RaggedShard
from shard_planner import Plan, TensorSpec

__all__ = ["ParamGroup", "ParamRef", "ShardState"]


class ShardState(enum.Enum):
    SHARDED = "sharded"
    UNSHARDED = "unsharded"


@attrs.frozen
class ParamRef:
    """Where a managed parameter is registered: ``owner.<attr>``, named ``fqn``.

    ``aliases`` are further ``(module, attr)`` places registering the same parameter object (tied
    weights, e.g. an output head sharing the embedding): they get the same sharded and unsharded
    parameters, so the tie is kept.
    """

    owner: nn.Module
    attr: str
    fqn: str
    aliases: tuple[tuple[nn.Module, str], ...] = ()

    def register(self, param: nn.Parameter) -> None:
        self.owner._parameters[self.attr] = param
        for module, attr in self.aliases:
            module._parameters[attr] = param


def build_plan(
    refs: Sequence[ParamRef],
    params: Sequence[torch.Tensor],
    world: int,
    block_policy: BlockPolicy | None,
    dtypes: Sequence[torch.dtype],
    method: str = "auto",
) -> Plan:
    """The group's plan: blocks from ``block_policy``, 16-byte aligned in every one of
    ``dtypes`` (``plans`` [Note: alignment in every dtype]), cached by signature."""
    specs = []
    for ref, param in zip(refs, params, strict=True):
        block = 1
        if block_policy is not None:
            try:
                value = block_policy(ref.fqn, param)
            except Exception as exc:
                where = (
                    f"block policy {block_policy!r} failed for parameter {ref.fqn!r} "
                    f"(shape {tuple(param.shape)})"
                )
                try:
                    renamed = type(exc)(f"{where}: {exc}")
                except Exception:  # an exception type that needs other arguments
                    exc.add_note(where)
                    raise exc from None
                raise renamed from exc
            try:
                block = operator.index(value)
            except TypeError:
                raise TypeError(
                    f"block policy gave parameter {ref.fqn!r} the block {value!r} "
                    f"({type(value).__name__}); it must return an int number of "
                    f"elements"
                ) from None
        if block < 1 or param.numel() % block:
            raise ValueError(
                f"block policy gave parameter {ref.fqn!r} (shape "
                f"{tuple(param.shape)}, {param.numel()} elements) a block of {block} "
                f"elements: it must be >= 1 and divide the parameter's numel"
            )
        specs.append(TensorSpec(numel=param.numel(), block=block, name=ref.fqn))
    return cached_plan(specs, world, dtypes, method=method)


class ParamGroup:
    """The parameters of one ``fully_shard`` call over one mesh (1-D, or 2-D HSDP)."""

    def __init__(
        self,
        refs: Sequence[ParamRef],
        mesh: DeviceMesh,
        *,
        mp_policy: MixedPrecisionPolicy,
        block_policy: BlockPolicy | None,
        shard_axis: int,
        planner: str = "auto",
    ) -> None:
        self.refs = tuple(refs)
        self.mesh = mesh
        self.mp_policy = mp_policy
        params = [getattr(r.owner, r.attr) for r in refs]
        # Parameters already distributed by tensor/expert parallelism: the group holds their
        # local shards, and RaggedShard on the data-parallel axis cuts those (innermost).
        self.tp_specs = [_tp_spec(r, p, mesh) for r, p in zip(refs, params, strict=True)]
        originals = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        dtypes = {p.dtype for p in originals}
        if len(dtypes) != 1:
            named = ", ".join(f"{r.fqn}: {p.dtype}" for r, p in zip(refs, originals, strict=True))
            raise ValueError(f"fully_shard needs one dtype per group; got {named}")
        self.dtype = dtypes.pop()
        self.compute_dtype = mp_policy.param_dtype or self.dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.compute_dtype
        self.requires_grad = tuple(p.requires_grad for p in originals)
        self.world = mesh.size(shard_axis)
        self.plan = build_plan(
            refs,
            originals,
            self.world,
            block_policy,
            (self.dtype, self.compute_dtype, self.reduce_dtype),
            method=planner,
        )
        shapes = [tuple(p.shape) for p in originals]
        names = [r.fqn for r in refs]
        self.params = DBuffer(
            self.plan,
            shapes,
            mesh,
            dtype=self.dtype,
            names=names,
            shard_axis=shard_axis,
            check=True,
        )
        # [Note: gradient storage lifetimes]
        # Unsharded gradients (compute dtype) live only from pre-backward to their reduction.
        # Sharded gradients (parameter dtype) live from the first reduction until every sharded
        # parameter's .grad was dropped (zero_grad(set_to_none=True)): then the buffer is let go
        # and a fresh one is made by the next reduction, so between steps and through forward
        # and backward no gradient memory is held, like FSDP2. Views a user still holds keep
        # their (refcounted) storage alive; nothing is freed under them.
        self.grads: DBuffer | None = None
        self.unsharded_grads = self.params.new_like(self.compute_dtype)
        self.unsharded_grads.shard.untyped_storage().resize_(0)  # only its unsharded part is used
        with torch.no_grad():
            if not any(p.is_meta for p in originals):
                self.params.load_full_([p.detach().to(self.params.device) for p in originals])
        self.sharded = [
            nn.Parameter(self._sharded_view(i, view, self.params), requires_grad=rg)
            for i, (view, rg) in enumerate(
                zip(self.params.sharded_views(), self.requires_grad, strict=True)
            )
        ]
        self._unsharded: dict[torch.dtype, list[nn.Parameter]] = {}
        self.state = ShardState.SHARDED
        self.unshard_handle: Handle | None = None
        self.reduce_handle: Handle | None = None
        self.post_forward_chunk: torch.Tensor | None = None
        self.subgroup_size = 1
        self.subgroup: dist.ProcessGroup | None = None
        self.subgroup_index = 0
        self._grad_views: list[DTensor] | None = None
        self.grads_pending = False  # unsharded gradients accumulated, not yet reduced
        self.grad_seen = [False] * len(self.refs)  # in the current backward pass
        self.grad_received = [False] * len(self.refs)  # since the last reduction
        self.divide_factor: float | None = None
        self.register_sharded()

    # -- parameter registration ---------------------------------------------------------------
    def _sharded_view(self, i: int, view: DTensor, buffer: DBuffer) -> DTensor:
        """Tensor ``i``'s shard as a DTensor; for a TP parameter, over the dp x tp mesh."""
        tp = self.tp_specs[i]
        if tp is None:
            return view
        local = buffer.local_views()[i]
        placements = (*buffer.placements[i], *tp.placements)
        return DTensor.from_local(
            local, tp.spmd_mesh, placements, run_check=False, shape=tp.shape, stride=tp.stride
        )

    def _unsharded_view(self, i: int, full: torch.Tensor) -> torch.Tensor:
        tp = self.tp_specs[i]
        if tp is None:
            return full
        return DTensor.from_local(
            full, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride
        )

    def unsharded_params(self) -> list[nn.Parameter]:
        params = self._unsharded.get(self.compute_dtype)
        if params is None:
            views = self.params.full_views(self.compute_dtype, allow_released=True)
            params = [
                nn.Parameter(self._unsharded_view(i, v), requires_grad=rg)
                for i, (v, rg) in enumerate(zip(views, self.requires_grad, strict=True))
            ]
            self._unsharded[self.compute_dtype] = params
        return params

    def register_sharded(self) -> None:
        for ref, param in zip(self.refs, self.sharded, strict=True):
            ref.register(param)

    def register_unsharded(self) -> None:
        for ref, param in zip(self.refs, self.unsharded_params(), strict=True):
            ref.register(param)

    def reset_sharded_params(self) -> None:
        """After ``nn.Module._apply`` (``to_empty``, ``.to``): put our storage back under the
        module's sharded parameters, keeping any values they were given."""
        with torch.no_grad():
            for i, ref in enumerate(self.refs):
                current = ref.owner._parameters[ref.attr]
                ours = self.params.local_views()[i]
                if not isinstance(current, DTensor):
                    raise TypeError(f"parameter {ref.fqn!r} is no longer a DTensor after _apply")
                local = current._local_tensor
                if local.untyped_storage().data_ptr() != ours.untyped_storage().data_ptr() or (
                    local.storage_offset() != ours.storage_offset()
                ):
                    if not local.is_meta:
                        ours.copy_(local.reshape(-1))
                    current._local_tensor = ours
                assert isinstance(current, nn.Parameter)
                self.sharded[i] = current

    # -- unshard / reshard -------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        if self.state is ShardState.UNSHARDED or self.unshard_handle is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.post_forward_chunk is not None:
            self._unshard_from_chunk()
            return
        self.unshard_handle = self.params.unshard(dtype=self.compute_dtype, async_op=async_op)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        if self.unshard_handle is not None:
            self.unshard_handle.wait()  # DBuffer restores the version counter autograd checks
            self.unshard_handle = None
            self.state = ShardState.UNSHARDED

    def reshard(self) -> None:
        self.wait_for_unshard()
        self.params.reshard()
        self.post_forward_chunk = None
        self.register_sharded()
        self.state = ShardState.SHARDED

    # -- reshard_after_forward=k: keep 1/k of the unsharded buffer between forward and backward --
    # [Note: resharding to a sub-group]
    # With k ranks per sub-group (consecutive coordinates of the shard axis), each rank keeps the
    # k-th part of the unsharded flat buffer that its position in the sub-group names (m*S/k
    # elements, so the sub-group holds the whole buffer), and backward rebuilds the buffer with
    # one all-gather inside the sub-group: less memory than keeping it (k > 1), cheaper
    # communication than a full reshard (k < m), e.g. k = ranks per node.
    def setup_subgroup(self, k: int) -> None:
        world = self.world
        if world % k:
            raise ValueError(f"reshard_after_forward={k} must divide the shard-axis size {world}")
        if self.mesh.ndim != 1:
            raise NotImplementedError("reshard_after_forward as an int with HSDP is not supported")
        ranks = self.mesh.mesh.flatten()
        sub = DeviceMesh(self.mesh.device_type, ranks.view(world // k, k))
        self.subgroup_size = k
        self.subgroup = sub.get_group(1)
        self.subgroup_index = self.params.rank % k

    def reshard_to_subgroup(self) -> None:
        """Post-forward: keep this rank's 1/k part of the unsharded buffer, free the rest."""
        self.wait_for_unshard()
        flat = self.params.unsharded_flat(self.compute_dtype)
        part = flat.numel() // self.subgroup_size
        start = self.subgroup_index * part
        chunk = flat[start : start + part].clone()
        self.reshard()
        self.post_forward_chunk = chunk

    def _unshard_from_chunk(self) -> None:
        chunk = self.post_forward_chunk
        assert chunk is not None
        self.params.alloc_unsharded(dtype=self.compute_dtype)
        flat = self.params.unsharded_flat(self.compute_dtype)
        with _unsafe_preserve_version_counter(flat):
            dist.all_gather_single(flat, chunk, group=self.subgroup)
        self.post_forward_chunk = None
        self.state = ShardState.UNSHARDED

    # -- gradients ---------------------------------------------------------------------------
    def prepare_gradients(self) -> None:
        """Before this group's backward: unsharded gradient storage, zeroed once, attached as
        the ``.grad`` of the unsharded parameters so autograd accumulates in place."""
        self.grad_seen = [False] * len(self.refs)
        if self.grads_pending:  # accumulating across backward passes without sync
            return
        self.unsharded_grads.alloc_unsharded(zero=True)
        views = self.unsharded_grads.full_views()
        for i, (param, view, rg) in enumerate(
            zip(self.unsharded_params(), views, self.requires_grad, strict=True)
        ):
            if rg:
                param.grad = self._unsharded_view(i, view)
        self.grad_received = [False] * len(self.refs)
        self.grads_pending = True

    def note_gradient(self, index: int) -> bool:
        """Record that parameter ``index`` received its gradient; True when all have."""
        self.grad_seen[index] = True
        self.grad_received[index] = True
        return all(
            seen or not rg for seen, rg in zip(self.grad_seen, self.requires_grad, strict=True)
        )

    def reduce_gradients(self, *, async_op: bool) -> None:
        """One reduce-scatter (plus one all-reduce per replicate axis for HSDP) of the group."""
        if not self.grads_pending:
            return
        existing = [p.grad for p in self.sharded]
        accumulate = any(g is not None for g in existing)
        if self.grads is None:
            if accumulate:
                first = next(i for i, g in enumerate(existing) if g is not None)
                raise RuntimeError(
                    f"parameter {self.refs[first].fqn!r}: has a .grad the engine did not make; "
                    "use zero_grad() before the first backward"
                )
            self.grads = self.params.new_like(self.dtype)
            self._grad_views = None
        grads = self.grads
        if accumulate:
            for i, grad in enumerate(existing):
                if grad is None:
                    grads.local_views()[i].zero_()
                elif not _is_view_of(grad, grads.local_views()[i]):
                    raise RuntimeError(
                        f"parameter {self.refs[i].fqn!r}: .grad was replaced by a "
                        f"tensor that is not the engine's gradient storage; use "
                        f"zero_grad() or accumulate into it in place"
                    )
        op: Literal["sum", "avg"] = "avg"
        if self.divide_factor is not None:
            self.unsharded_grads.scale_(1.0 / self.divide_factor, part="unsharded")
            op = "sum"
        # detach autograd's references before the storage is released
        for param in self.unsharded_params():
            param.grad = None
        self.reduce_handle = self.unsharded_grads.reduce_scatter(
            op=op,
            reduce_dtype=self.reduce_dtype,
            accumulate=accumulate,
            into=grads,
            free_unsharded=True,
            async_op=async_op,
        )
        views = self._sharded_grad_views()
        for i, param in enumerate(self.sharded):
            seen = self.grad_received[i] or existing[i] is not None
            param.grad = views[i] if (seen and self.requires_grad[i]) else None
        self.grads_pending = False

    def _sharded_grad_views(self) -> list[DTensor]:
        grads = self.grads
        assert grads is not None
        if self._grad_views is None:
            self._grad_views = [
                self._sharded_view(i, view, grads) for i, view in enumerate(grads.sharded_views())
            ]
        return self._grad_views

    def release_dropped_gradients(self) -> None:
        """Let the sharded gradient buffer go once no parameter's .grad refers to it."""
        if self.grads is None or self.grads_pending or self.reduce_handle is not None:
            return
        if all(p.grad is None for p in self.sharded):
            self.grads = None
            self._grad_views = None

    def wait_for_reduce(self) -> None:
        if self.reduce_handle is not None:
            self.reduce_handle.wait()
            self.reduce_handle = None

    def drop_pending_gradients(self) -> None:
        for param in self.unsharded_params():
            param.grad = None
        self.unsharded_grads.reshard()
        self.grads_pending = False


@attrs.frozen
class TPSpec:
    """A parameter that is already a DTensor (tensor/expert parallel) on another mesh."""

    mesh: DeviceMesh  # the parameter's own mesh (e.g. "tp")
    placements: tuple[Placement, ...]
    shape: torch.Size  # global shape
    stride: tuple[int, ...]
    spmd_mesh: DeviceMesh  # data-parallel mesh x the parameter's mesh


def _tp_spec(ref: ParamRef, param: torch.Tensor, dp_mesh: DeviceMesh) -> TPSpec | None:
    if not isinstance(param, DTensor):
        return None
    if any(isinstance(p, RaggedShard) for p in param.placements):
        raise ValueError(
            f"parameter {ref.fqn!r} is already RaggedShard-sharded "
            f"({param.placements}); fully_shard it once"
        )
    if dp_mesh.ndim != 1:
        raise NotImplementedError(
            f"parameter {ref.fqn!r} is a DTensor on {param.device_mesh}: "
            "combining tensor parallelism with HSDP is not supported yet"
        )
    if any(p.is_partial() for p in param.placements):
        raise ValueError(f"parameter {ref.fqn!r} has a Partial placement {param.placements}")
    if not param.to_local().is_contiguous():
        raise ValueError(f"parameter {ref.fqn!r}: its local shard is not contiguous")
    try:
        spmd = DeviceMesh._concatenate([dp_mesh, param.device_mesh])
    except Exception as exc:  # torch raises several types here
        raise ValueError(
            f"parameter {ref.fqn!r} lives on {param.device_mesh}, which does not "
            f"combine with the data-parallel mesh {dp_mesh} (both must be slices of "
            f"one parent mesh, e.g. mesh['dp'] and mesh['tp']): {exc}"
        ) from exc
    return TPSpec(
        param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()), spmd
    )


def _is_view_of(tensor: torch.Tensor, local: torch.Tensor) -> bool:
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return bool(
        inner.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        and inner.storage_offset() == local.storage_offset()
    )


def barrier_check(mesh: DeviceMesh) -> None:
    """Fail fast if the process group of ``mesh`` does not answer (a mis-built mesh)."""
    dist.barrier(group=mesh.get_group(0))
