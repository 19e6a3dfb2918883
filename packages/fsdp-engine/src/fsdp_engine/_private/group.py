"""One dtype's parameters of a ``fully_shard`` call: one flat buffer, one collective each way.

[Note: plan, then hold]
``ParamGroup`` asks the planner for a layout (each parameter contiguous, no block cut, equal
shards), then holds the parameters in a ``DBuffer``: the module's registered parameters become
``RaggedShard`` DTensor views of the shard storage (what the optimizer updates, in place), and the
parameters used in forward/backward are plain views of the unsharded storage, which one all-gather
fills and ``reshard`` frees. Gradients mirror it: autograd accumulates into views of an unsharded
gradient storage (pre-zeroed once per backward, one kernel), one reduce-scatter writes the sharded
gradient storage whose views are the sharded parameters' ``.grad``. Nothing is copied in or out.

A ``fully_shard`` call whose parameters have several dtypes gets one ``ParamGroup`` per dtype
(``FSDPState.groups``): one collective per dtype, each over a buffer of one dtype.

[Note: conditional compute]
A parameter that gets no gradient on some rank (a branch skipped there, an expert that received
no tokens) is a zero contribution: the unsharded gradient storage is zeroed before backward and
the reduction always covers every trainable parameter of the group. So every rank issues the
same collective with the same sizes whatever its data did, and after the reduction every
trainable parameter has a ``.grad`` (the mean over ranks, zeros if no rank used it) on every rank:
the same presence everywhere, like FSDP2's ``set_reduce_scatter_unused_params(True)``, always on.

[Note: frozen parameters]
``requires_grad`` is read from the sharded parameters at every unshard (FSDP2's rule), so
freezing or unfreezing after ``fully_shard`` takes effect at the next forward. A group whose
parameters are all trainable uses the zero-copy path above. A group with frozen members reduces
only its trainable members: autograd makes their unsharded gradients, post-backward adds them
into a compact reduce-scatter input (each rank's segment holds the trainable pieces of that
rank's shard, see ``compact_pieces``) and the reduce-scatter writes a compact sharded gradient
storage whose slices are exactly the trainable parameters' local shares. Frozen parameters are
neither communicated nor given a ``.grad``.
"""

from __future__ import annotations

import enum
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any, Literal

import attrs
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from dbuffer import DBuffer, Handle, contiguous_layout
from fsdp_engine._private.dim_shard import (
    chunk_shape,
    from_chunk_major,
    local_chunk,
    shard_dim_plan,
    to_chunk_major,
)
from fsdp_engine._private.plans import alignment, cached_plan
from fsdp_engine._private.policy import BlockPolicy, MixedPrecisionPolicy
from fsdp_engine._private.quantized_gather import (
    QuantizedGather,
    TileAlignedBlocks,
    quantized_gather,
    select_quantized,
)
from ragged_dtensor import RaggedShard
from shard_planner import Plan, TensorSpec

__all__ = ["ParamGroup", "ParamRef", "ShardState", "compact_pieces"]


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

    def registered(self) -> Any:
        return self.owner._parameters.get(self.attr)


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


Piece = tuple[
    int, int, int, int
]  # (tensor index, start inside the tensor, length, start in segment)


def compact_pieces(
    offsets: Sequence[int],
    numels: Sequence[int],
    shard_size: int,
    world: int,
    trainable: Sequence[bool],
    align: int,
) -> tuple[int, tuple[tuple[Piece, ...], ...]]:
    """The compact reduction layout of the trainable subset of a planned group.

    Rank r's shard of the parameter buffer is ``[r*S, (r+1)*S)``; tensor i occupies
    ``[off_i, off_i + n_i)``, so its piece on rank r is the intersection, of length
    ``max(0, min(off_i + n_i, (r+1)*S) - max(off_i, r*S))``. Segment r of the compact buffer holds
    the pieces of the trainable tensors on rank r, in tensor order, back to back; the segment size
    is ``S_g = max_r (sum of those lengths)`` rounded up to ``align``. A reduce-scatter of
    ``world`` segments then leaves on rank r exactly the trainable tensors' local shares, each a
    contiguous slice. Returns ``(S_g, pieces)`` with ``pieces[r]`` the ``(i, start in tensor,
    length, start in segment)`` of every trainable tensor on rank r (length 0 included, so every
    rank has a view for every trainable tensor).
    """
    by_rank: list[tuple[Piece, ...]] = []
    largest = 0
    for r in range(world):
        lo, hi = r * shard_size, (r + 1) * shard_size
        cursor = 0
        pieces: list[Piece] = []
        for i, (off, numel) in enumerate(zip(offsets, numels, strict=True)):
            if not trainable[i]:
                continue
            start, stop = max(off, lo), min(off + numel, hi)
            length = max(0, stop - start)
            pieces.append((i, start - off if length else 0, length, cursor))
            cursor += length
        largest = max(largest, cursor)
        by_rank.append(tuple(pieces))
    size = max(align, -(-largest // align) * align)
    return size, tuple(by_rank)


@attrs.frozen
class _Reduction:
    """How a group reduces its gradients for one trainable mask."""

    mask: tuple[bool, ...]
    kind: Literal["none", "full", "compact"]
    segment: int = 0  # compact: elements per rank
    pieces: tuple[tuple[Piece, ...], ...] = ()


class ParamGroup:
    """The parameters of one dtype of one ``fully_shard`` call over one mesh (1-D or 2-D HSDP)."""

    def __init__(
        self,
        refs: Sequence[ParamRef],
        mesh: DeviceMesh,
        *,
        mp_policy: MixedPrecisionPolicy,
        block_policy: BlockPolicy | None,
        shard_axis: int,
        planner: str = "auto",
        shard_dim: int | None = None,
    ) -> None:
        self.refs = tuple(refs)
        self.mesh = mesh
        self.mp_policy = mp_policy
        self.shard_axis = shard_axis
        params = [r.registered() for r in refs]
        # Parameters already distributed by tensor/expert parallelism: the group holds their
        # local shards, and RaggedShard on the data-parallel axis cuts those (innermost).
        self.tp_specs = [_tp_spec(r, p, mesh) for r, p in zip(refs, params, strict=True)]
        originals = [p.to_local() if isinstance(p, DTensor) else p for p in params]
        dtypes = {p.dtype for p in originals}
        if len(dtypes) != 1:  # the caller splits a call's parameters by dtype
            raise ValueError(f"ParamGroup holds one dtype, got {sorted(map(str, dtypes))}")
        self.dtype: torch.dtype = dtypes.pop()
        self.world = mesh.size(shard_axis)
        self.shapes = [tuple(p.shape) for p in originals]
        # [Note: Shard(d) groups] (dim_shard): one parameter in FSDP2's layout; d > 0 is
        # stored chunk-major and copied out/in around the collectives
        self.shard_dim = shard_dim
        self.copies = shard_dim is not None and shard_dim > 0 and self.world > 1
        # [Note: quantized all-gather of a group]: the chosen weights' shares are whole blocks
        quantization = mp_policy.quantized_all_gather
        quantized = select_quantized(quantization, [r.fqn for r in refs], params)
        if shard_dim is not None:
            if len(refs) != 1 or self.tp_specs[0] is not None or any(quantized):
                raise NotImplementedError(
                    f"fully_shard: Shard({shard_dim}) for {[r.fqn for r in refs]} is supported "
                    "for one plain (not tensor-parallel, not quantized-all-gather) parameter"
                )
            self.plan = shard_dim_plan(refs[0].fqn, self.shapes[0], shard_dim, self.world)
        else:
            if quantization is not None and any(quantized):
                chosen = frozenset(r.fqn for r, q in zip(refs, quantized, strict=True) if q)
                block_policy = TileAlignedBlocks(quantization, chosen, block_policy)
            self.plan = build_plan(
                refs, originals, self.world, block_policy, self._view_dtypes(), planner
            )
        self.params = DBuffer(
            self.plan,
            [(p.numel(),) if self.copies else tuple(p.shape) for p in originals],
            mesh,
            dtype=_storage_dtype(self.dtype),
            names=[r.fqn for r in refs],
            shard_axis=shard_axis,
            check=True,
        )
        self.quantized: QuantizedGather | None = quantized_gather(
            quantization, self.params, quantized
        )
        # [Note: meta-device parameters]
        # A group built from meta parameters keeps meta sharded parameters (FSDP2's behaviour)
        # and releases its shard storage; ``to_empty``/``load_state_dict(assign=True)``/a
        # replaced parameter allocates it again (same storage object, so every view stays valid).
        self.materialized = True
        if all(p.is_meta for p in originals):
            self.params.shard.untyped_storage().resize_(0)
            self.materialized = False
        else:
            with torch.no_grad():
                for i, p in enumerate(originals):
                    if not p.is_meta:
                        self._load_full(i, p.detach().to(self.params.device))
        self.sharded: list[nn.Parameter] = [
            nn.Parameter(self._dtensor_of(i, self._local_or_meta(i, o)), p.requires_grad)
            for i, (o, p) in enumerate(zip(originals, params, strict=True))
        ]
        self._set_dtypes()
        self.state = ShardState.SHARDED
        self.unshard_handle: Handle | None = None
        self.reduce_handle: Handle | None = None
        self.post_forward_chunk: torch.Tensor | None = None
        self._chunk_ready: torch.Event | None = None
        # the event marking the shards' last write this iteration (accelerators; set and
        # cleared by the root), which all-gathers wait on instead of the compute stream
        self.inputs_ready: torch.Event | None = None
        self.subgroup_size = 1
        self.subgroup: dist.ProcessGroup | None = None
        self.subgroup_index = 0
        self.divide_factor: float | None = None
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.custom_all_gather: Any = None
        self.custom_reduce_scatter: Any = None
        self.force_sum_reduction = False
        # set_reduce_scatter_unused_params(False): drop the .grad of parameters no rank used,
        # decided with one small all-reduce per backward ([Note: gradient presence])
        self.exact_presence = False
        self.conversion_incomplete: list[str] | None = None
        self.register_sharded()

    def _set_dtypes(self) -> None:
        """Compute and reduce dtypes from the policy and the parameters' dtype; (re)make the
        storages whose dtype depends on them."""
        floating = self.dtype.is_floating_point and _storage_dtype(self.dtype) == self.dtype
        self.compute_dtype: torch.dtype = (self.mp_policy.param_dtype if floating else None) or (
            self.dtype
        )
        # what the all-gather moves: the compute dtype, or the same bytes as integers for the
        # dtypes collectives do not carry (float8: [Note: bit-cast storage])
        bitcast = self.params.dtype != self.dtype
        self.gather_dtype = self.params.dtype if bitcast else self.compute_dtype
        self.reduce_dtype: torch.dtype = (
            self.mp_policy.reduce_dtype if floating else None
        ) or self.compute_dtype
        self._unsharded: dict[torch.dtype, list[nn.Parameter]] = {}
        self._hooked: list[bool] = []
        # [Note: gradient storage lifetimes]
        # Unsharded gradients (compute dtype) live only from pre-backward to their reduction.
        # Sharded gradients (parameter dtype) live from the first reduction until every sharded
        # parameter's .grad was dropped (zero_grad(set_to_none=True)): then the buffer is let go
        # and a fresh one is made by the next reduction, so between steps and through forward
        # and backward no gradient memory is held, like FSDP2. Views a user still holds keep
        # their (refcounted) storage alive; nothing is freed under them.
        self.unsharded_grads = self.params.new_like(self.compute_dtype)
        self.unsharded_grads.shard.untyped_storage().resize_(0)  # only its unsharded part is used
        self._unsharded_grad_views: list[torch.Tensor] | None = None
        # sharded gradients: the buffer and its views are kept across zero_grad(set_to_none=
        # True); only their memory is released and re-allocated (release_dropped_gradients)
        self.grads: DBuffer | None = None
        self._grad_views: list[DTensor | None] | None = None
        self._reduction: _Reduction | None = None
        # no-sync accumulation in reduce_dtype (full path), or the compact reduction's input
        self.accum: DBuffer | None = None
        self.pending = False  # unsharded gradients written by autograd, not yet reduced
        self.accum_pending = False  # gradients held in ``accum``, not yet reduced
        self._hooks_due = False
        # [Note: gradient presence] which trainable parameters got a gradient on this rank since
        # the last reduction (full path: set by a post-accumulate hook on the unsharded ones)
        self._used = [False] * len(self.refs)
        self._presence_due: list[bool] | None = None  # after the reduction: had a .grad before

    def _view_dtypes(self) -> tuple[torch.dtype, ...]:
        """Every dtype the group's buffers are viewed in: the parameters', their storage's, and
        the mixed-precision policy's compute and reduce dtypes (``plans`` [Note: alignment in
        every dtype]). A later ``.to(dtype)`` keeps the plan (aligned for these)."""
        dtypes = [self.dtype, _storage_dtype(self.dtype)]
        if self.dtype.is_floating_point:
            policy = self.mp_policy
            dtypes += [d for d in (policy.param_dtype, policy.reduce_dtype) if d is not None]
        return tuple(dtypes)

    # -- geometry helpers ---------------------------------------------------------------------
    @property
    def single_rank(self) -> bool:
        """The whole mesh is one rank: no collective at all (FSDP2 issues none either)."""
        return self.mesh.size() == 1

    def _local(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s share of the shard storage, in the parameter's dtype (a view)."""
        flat = self.params.local_views()[i].view(self.dtype)
        return flat if self.shard_dim is None else flat.view(self._local_shape(i))

    def _local_shape(self, i: int) -> tuple[int, ...]:
        """The shape of parameter ``i``'s local tensor: flat (RaggedShard), or its chunk."""
        numel = self.params.slots[i].local_numel
        if self.shard_dim is None:
            return (numel,)
        if self.shard_dim == 0:
            rest = self.shapes[i][1:]
            row = math.prod(rest)
            return (numel // row if row else 0, *rest)
        return chunk_shape(self.shapes[i], self.shard_dim, self.world)

    def _part_of_full(self, i: int, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of parameter ``i``'s full value, flat."""
        if self.copies:
            assert self.shard_dim is not None
            return local_chunk(full, self.shard_dim, self.world, self.params.rank)
        slot = self.params.slots[i]
        return full.reshape(-1)[slot.tensor_start : slot.tensor_start + slot.local_numel]

    def _load_full(self, i: int, tensor: torch.Tensor) -> None:
        self._local(i).view(-1).copy_(self._part_of_full(i, tensor))

    def _local_or_meta(self, i: int, original: torch.Tensor) -> torch.Tensor:
        local = self._local(i)
        if original.is_meta:
            return torch.empty(local.shape, dtype=local.dtype, device="meta")
        return local

    def _dtensor_of(self, i: int, local: torch.Tensor) -> DTensor:
        """A DTensor over ``local`` (this rank's flat share of parameter ``i``, no copy)."""
        slot = self.params.slots[i]
        tp = self.tp_specs[i]
        if self.shard_dim is not None:
            shape = self.shapes[i]
            stride = torch.empty(shape, device="meta").stride()
            fsdp2: tuple[Placement, ...] = (Replicate(),) * (self.mesh.ndim - 1) + (
                Shard(self.shard_dim),
            )
            return DTensor.from_local(
                local.view(self._local_shape(i)),
                self.mesh,
                fsdp2,
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )
        if tp is None:
            return DTensor.from_local(
                local,
                self.mesh,
                self.params.placements[i],
                run_check=False,
                shape=torch.Size(slot.shape),
                stride=slot.stride,
            )
        placements = (*self.params.placements[i], *tp.placements)
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

    # -- parameter registration ---------------------------------------------------------------
    def trainable(self) -> tuple[bool, ...]:
        return tuple(p.requires_grad for p in self.sharded)

    def _views_are_the_shard(self) -> bool:
        """On one rank the unsharded parameters can be the shard itself (no gather, no copy)."""
        return (
            self.world == 1
            and self.compute_dtype == self.dtype
            and self.materialized
            and self.quantized is None  # one rank still quantizes: the same weights as m ranks
        )

    def unsharded_params(self) -> list[nn.Parameter]:
        params = self._unsharded.get(self.compute_dtype)
        if params is None:
            if self._views_are_the_shard():
                views: Sequence[torch.Tensor] = [
                    self._local(i).view(slot.shape) for i, slot in enumerate(self.params.slots)
                ]
            elif self.copies:  # [Note: Shard(d) groups]: its own storage, filled by a copy
                device, dtype = self.params.device, self.compute_dtype
                views = [torch.empty(s, dtype=dtype, device=device) for s in self.shapes]
            else:
                full = self.params.full_views(self.gather_dtype, allow_released=True)
                views = [v.view(self.compute_dtype) for v in full]
            params = [
                nn.Parameter(self._unsharded_view(i, v), requires_grad=p.requires_grad)
                for i, (v, p) in enumerate(zip(views, self.sharded, strict=True))
            ]
            self._hooked = [False] * len(params)
            self._unsharded[self.compute_dtype] = params
            for i, param in enumerate(params):
                self._hook_used(i, param)
        return params

    def _hook_used(self, i: int, param: nn.Parameter) -> None:
        """Exact presence only: note that parameter ``i`` got a gradient on this rank (autograd
        accumulated into its unsharded view); hooks exist only on tensors that require grad."""
        if not self.exact_presence or self._hooked[i] or not param.requires_grad:
            return

        def hook(_: torch.Tensor) -> None:
            self._used[i] = True

        param.register_post_accumulate_grad_hook(hook)  # type: ignore[no-untyped-call]
        self._hooked[i] = True

    def register_sharded(self) -> None:
        for ref, param in zip(self.refs, self.sharded, strict=True):
            ref.register(param)

    def register_unsharded(self) -> None:
        params = self.unsharded_params()
        for i, (ref, sharded, param) in enumerate(
            zip(self.refs, self.sharded, params, strict=True)
        ):
            if param.requires_grad != sharded.requires_grad:  # frozen/unfrozen since last time
                param.requires_grad_(sharded.requires_grad)
            self._hook_used(i, param)
            ref.register(param)

    def meta_indices(self) -> list[int]:
        return [i for i, p in enumerate(self.sharded) if _dtensor(p).to_local().is_meta]

    def _materialize(self) -> None:
        if self.materialized:
            return
        storage = self.params.shard.untyped_storage()
        storage.resize_(self.params.shard.numel() * self.params.shard.element_size())
        with _unsafe_preserve_version_counter(self.params.shard):
            self.params.shard.zero_()
        self.materialized = True
        self._unsharded = {}

    def to_sharded(self) -> None:
        """Register the sharded parameters, taking over any the user put in their place."""
        if self.state is ShardState.SHARDED and self.unshard_handle is None:
            self.adopt_registered()
        self.reshard()

    def adopt_registered(self) -> None:
        """Take over parameters the user registered in place of ours while sharded (FSDP2's
        ``reset_sharded_param``): ``model.w = nn.Parameter(...)``, ``load_state_dict(assign=
        True)``. A DTensor with our placements keeps its object (its local tensor becomes a view
        of our storage); any other value is read as the full tensor (a DTensor in another layout
        is redistributed, which is a collective: every rank adopts at the same call)."""
        if self.state is not ShardState.SHARDED:
            return
        unsharded = self._unsharded.get(self.compute_dtype, [])
        for i, ref in enumerate(self.refs):
            current = ref.registered()
            if current is self.sharded[i] or (i < len(unsharded) and current is unsharded[i]):
                continue
            if not isinstance(current, torch.Tensor):
                raise ValueError(
                    f"parameter {ref.fqn!r} managed by fully_shard was replaced by "
                    f"{type(current).__name__}; assign a tensor parameter"
                )
            self._adopt(i, current)

    def _adopt(self, i: int, value: torch.Tensor) -> None:
        ref = self.refs[i]
        if tuple(value.shape) != tuple(self.sharded[i].shape):
            raise ValueError(
                f"parameter {ref.fqn!r}: the assigned value has shape {tuple(value.shape)}, "
                f"fully_shard manages it with shape {tuple(self.sharded[i].shape)}"
            )
        ours = self._local(i)
        local: torch.Tensor | None
        ours_placements = tuple(_dtensor(self.sharded[i]).placements)
        if isinstance(value, DTensor) and tuple(value.placements) == ours_placements:
            local = value._local_tensor
        elif isinstance(value, DTensor):
            local = self._part_of_full(i, value.full_tensor())
        else:
            local = self._part_of_full(i, value)
        if local.dtype != self.dtype:
            raise TypeError(
                f"parameter {ref.fqn!r}: the assigned value is {local.dtype}, the group holds "
                f"{self.dtype}; convert the module with .to({local.dtype}) instead"
            )
        requires_grad = value.requires_grad
        if local.is_meta:
            new_local = torch.empty(ours.shape, dtype=ours.dtype, device="meta")
        else:
            self._materialize()
            with torch.no_grad():
                ours.copy_(local.detach().reshape(ours.shape))
            new_local = ours
        if (
            isinstance(value, DTensor)
            and isinstance(value, nn.Parameter)
            and tuple(value.placements) == tuple(_dtensor(self.sharded[i]).placements)
        ):
            value._local_tensor = new_local
            param: nn.Parameter = value
        else:
            param = nn.Parameter(self._dtensor_of(i, new_local), requires_grad=requires_grad)
        self.sharded[i] = param
        ref.register(param)
        self._unsharded = {}

    def reset_after_apply(self) -> None:
        """After ``nn.Module._apply`` (``.to(dtype)``, ``.float()``, ``to_empty``...): adopt the
        dtype and values the sharded parameters were given, into our (possibly re-typed)
        storage.

        ``_apply`` either swaps the parameter with the converted DTensor (then its local tensor
        holds the converted values) or sets ``param.data`` (then only the wrapper's dtype/device
        changed and its local tensor is the old one): the wrapper's dtype and device are the
        truth, the local values are converted here when they were not."""
        currents = [ref.registered() for ref in self.refs]
        for ref, current in zip(self.refs, currents, strict=True):
            if not isinstance(current, DTensor):
                raise TypeError(f"parameter {ref.fqn!r} is no longer a DTensor after _apply")
        dtypes = {c.dtype for c in currents}
        if len(dtypes) != 1:
            # a group of several modules is converted module by module: wait for the rest
            self.conversion_incomplete = sorted(map(str, dtypes))
            return
        self.conversion_incomplete = None
        for ref, current in zip(self.refs, currents, strict=True):
            if current.device.type != "meta" and current.device != self.params.device:
                raise ValueError(
                    f"parameter {ref.fqn!r} was moved to {current.device}, but fully_shard's "
                    f"mesh lives on {self.params.device}; move the module before fully_shard"
                )
        new_dtype = dtypes.pop()
        grads = [c.grad for c in currents]
        if new_dtype != self.dtype:
            self.params = self.params.new_like(_storage_dtype(new_dtype))
            if not self.materialized:
                self.params.shard.untyped_storage().resize_(0)
            self.dtype = new_dtype
            self._set_dtypes()
        with torch.no_grad():
            for i, current in enumerate(currents):
                ours = self._local(i)
                local = current._local_tensor
                if current.device.type == "meta":
                    new_local = torch.empty(ours.shape, dtype=ours.dtype, device="meta")
                else:
                    self._materialize()
                    if not local.is_meta and not _is_view_of(local, ours):
                        ours.copy_(local.reshape(ours.shape))
                    new_local = ours
                current._local_tensor = new_local
                if current._spec.tensor_meta is None or (
                    current._spec.tensor_meta.dtype != new_local.dtype
                ):
                    current._spec = self._dtensor_of(i, new_local)._spec
                assert isinstance(current, nn.Parameter)
                self.sharded[i] = current
                self.refs[i].register(current)
        self._unsharded = {}
        if any(g is not None for g in grads):
            self._adopt_grads(grads)

    def _adopt_grads(self, grads: Sequence[torch.Tensor | None]) -> None:
        """Gradients that ``_apply`` converted (new tensors): copy them into our storage."""
        views = self._sharded_grad_views(self._reduction_for(self.trainable()))
        for i, (param, grad) in enumerate(zip(self.sharded, grads, strict=True)):
            view = views[i]
            if grad is None or view is None:
                param.grad = grad
                continue
            local = grad._local_tensor if isinstance(grad, DTensor) else grad
            with torch.no_grad():
                view._local_tensor.copy_(local.reshape(view._local_tensor.shape))
            param.grad = view

    # -- unshard / reshard -------------------------------------------------------------------
    def unshard(self, *, async_op: bool = False) -> None:
        """All-gather the group (``async_op``: issue it, ``wait_for_unshard`` completes it). On
        an accelerator the all-gather waits for ``inputs_ready`` (set by the root for an
        iteration: the shards' last write) instead of everything the compute stream has queued,
        so a prefetch overlaps the compute before it."""
        if self.state is ShardState.UNSHARDED or self.unshard_handle is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if self.conversion_incomplete is not None:
            raise ValueError(
                f"fully_shard: the parameters of one group were converted to different dtypes "
                f"{self.conversion_incomplete} ({[r.fqn for r in self.refs]}); convert every "
                f"module of a fully_shard call alike"
            )
        if not self.materialized:
            raise RuntimeError(
                f"fully_shard: parameters {[self.refs[i].fqn for i in self.meta_indices()]} are "
                "still on the meta device; materialize them (to_empty + init, or load a state "
                "dict with assign=True) before running forward"
            )
        if self.post_forward_chunk is not None:
            self._unshard_from_chunk(async_op=async_op)
            return
        if self._views_are_the_shard():
            self.state = ShardState.UNSHARDED
            return
        if self.quantized is not None:
            self._quantized_unshard(async_op=async_op)
            return
        if self.world == 1:  # mixed precision on one rank: a cast, no collective
            flat = self.params.alloc_unsharded(dtype=self.gather_dtype)
            unsharded = self.params.unsharded_flat(self.gather_dtype)
            with torch.no_grad(), _unsafe_preserve_version_counter(unsharded):
                unsharded.copy_(self.params.shard)
            del flat
            self._copy_out()
            self.state = ShardState.UNSHARDED
            return
        if self.custom_all_gather is not None:
            self._custom_unshard()
            return
        self.unshard_handle = self.params.unshard(
            dtype=self.gather_dtype, async_op=async_op, ready=self.inputs_ready
        )
        if not async_op:
            self.wait_for_unshard()

    def _quantized_unshard(self, *, async_op: bool) -> None:
        """One packed all-gather of codes, scales and the other parameters' values, dequantized
        into the compute-dtype unsharded storage ([Note: quantized all-gather of a group])."""
        assert self.quantized is not None
        if self.custom_all_gather is not None:
            raise ValueError(
                f"fully_shard: set_custom_all_gather and MixedPrecisionPolicy("
                f"quantized_all_gather=...) both replace the all-gather of group "
                f"{[r.fqn for r in self.refs]}; use one of them"
            )
        self.unshard_handle = self.quantized.unshard(
            self.params, dtype=self.gather_dtype, async_op=async_op, ready=self.inputs_ready
        )
        if not async_op:
            self.wait_for_unshard()

    def _custom_unshard(self) -> None:
        """A user all-gather (``set_custom_all_gather``) into our unsharded storage; it runs
        synchronously. Its ``allocate`` is not used: the engine's buffers are planned and
        persistent, and the collective writes straight into them."""
        self.params.alloc_unsharded(dtype=self.gather_dtype)
        out = self.params.unsharded_flat(self.gather_dtype)
        source = self.params.shard
        if source.dtype != self.gather_dtype:
            source = source.to(self.gather_dtype)
        group = self.mesh.get_group(self.shard_axis)
        with _unsafe_preserve_version_counter(out):
            work = self.custom_all_gather(
                output_tensor=out, input_tensor=source, group=group, async_op=False
            )
            if work is not None:
                work.wait()
        self._copy_out()
        self.state = ShardState.UNSHARDED

    def wait_for_unshard(self) -> None:
        if self.unshard_handle is not None:
            self.unshard_handle.wait()  # DBuffer restores the version counter autograd checks
            self.unshard_handle = None
            self._copy_out()
            self.state = ShardState.UNSHARDED

    def _copy_out(self) -> None:
        """[Note: Shard(d) groups]: the gathered chunk-major buffer into the unsharded
        parameter's own storage (allocated again after a reshard; same tensor, so autograd's
        saved references stay valid, and its version counter is kept like DBuffer's views)."""
        if not self.copies:
            return
        full = self.unsharded_params()[0]
        storage = full.untyped_storage()
        nbytes = full.numel() * full.element_size()
        if storage.nbytes() < nbytes:
            storage.resize_(nbytes)
        flat = self.params.unsharded_flat(self.gather_dtype).view(self.compute_dtype)
        assert self.shard_dim is not None
        with torch.no_grad(), _unsafe_preserve_version_counter(full):
            from_chunk_major(flat, full, self.shard_dim, self.world)
        # the gathered chunk-major buffer is not read again (FSDP2 frees its copy too), except
        # by reshard_after_forward=k, which keeps a part of it after forward
        if self.subgroup is None:
            self.params.reshard()

    def reshard(self) -> None:
        if (
            self.state is ShardState.SHARDED
            and self.unshard_handle is None
            and self.post_forward_chunk is None
        ):
            return  # already sharded: the registered parameters are the sharded ones
        self.wait_for_unshard()
        if not self._views_are_the_shard():
            self.params.reshard()
        if self.copies:
            for params in self._unsharded.values():
                params[0].untyped_storage().resize_(0)
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
        flat = self.params.unsharded_flat(self.gather_dtype)
        part = flat.numel() // self.subgroup_size
        start = self.subgroup_index * part
        chunk = flat[start : start + part].clone()
        self.reshard()
        self.post_forward_chunk = chunk
        self._chunk_ready = _event_now(chunk.device)

    def _unshard_from_chunk(self, *, async_op: bool) -> None:
        """Rebuild the unsharded buffer from the kept parts: one all-gather inside the
        sub-group, asynchronous like any unshard, so backward prefetches it too."""
        chunk = self.post_forward_chunk
        assert chunk is not None and self.subgroup is not None
        self.post_forward_chunk = None  # the handle holds it until the gather completes
        self.unshard_handle = self.params.gather_into(
            chunk,
            self.subgroup,
            dtype=self.gather_dtype,
            async_op=async_op,
            ready=self._chunk_ready,
        )
        self._chunk_ready = None
        if not async_op:
            self.wait_for_unshard()

    # -- gradients ---------------------------------------------------------------------------
    def _reduction_for(self, mask: tuple[bool, ...]) -> _Reduction:
        current = self._reduction
        if current is not None and current.mask == mask:
            return current
        if not any(mask):
            reduction = _Reduction(mask, "none")
        elif all(mask):
            reduction = _Reduction(mask, "full")
        else:
            segment, pieces = compact_pieces(
                self.plan.offsets,
                self.plan.numels,
                self.plan.shard_size,
                self.world,
                mask,
                alignment(self._view_dtypes()),
            )
            reduction = _Reduction(mask, "compact", segment, pieces)
        if current is not None and (self.pending or self.accum_pending):
            raise RuntimeError(
                "fully_shard: requires_grad of parameters changed while gradients were being "
                "accumulated without synchronization; change it between optimizer steps"
            )
        live = [p.grad for p in self.sharded]
        self._reduction = reduction
        self.accum = None
        if current is not None and self.grads is not None:
            self.grads = None
            self._grad_views = None
            if any(g is not None for g in live):
                self._adopt_grads(live)
        return reduction

    def prepare_gradients(self) -> None:
        """Before this group's backward. Full path: unsharded gradient storage, zeroed once,
        attached as the ``.grad`` of the unsharded parameters so autograd accumulates in place.
        Compact path: autograd makes the gradients; post-backward collects them."""
        reduction = self._reduction_for(self.trainable())
        if reduction.kind == "none" or self.pending:
            return
        # a module used twice in one backward: its first reduction may still read the storage
        # about to be zeroed for the second
        self.wait_for_reduce()
        if self.params.dtype != self.dtype:
            names = [r.fqn for r, rg in zip(self.refs, reduction.mask, strict=True) if rg]
            raise NotImplementedError(
                f"fully_shard: trainable {self.dtype} parameters {names}: gradients of this "
                "dtype cannot be reduced; keep them frozen (requires_grad=False)"
            )
        if not self.accum_pending:
            self._used = [False] * len(self.refs)
        if reduction.kind == "full" and self.copies:
            # [Note: Shard(d) groups]: autograd accumulates into a gradient of the
            # parameter's own shape; it is copied into chunk-major order at the reduction
            param = self.unsharded_params()[0]
            param.grad = torch.zeros_like(param, memory_format=torch.contiguous_format)
        elif reduction.kind == "full":
            self.unsharded_grads.alloc_unsharded(zero=True)
            if self._unsharded_grad_views is None:  # made once (a DTensor each for TP)
                full = self.unsharded_grads.full_views()
                self._unsharded_grad_views = [
                    self._unsharded_view(i, v) for i, v in enumerate(full)
                ]
            for param, view in zip(
                self.unsharded_params(), self._unsharded_grad_views, strict=True
            ):
                param.grad = view
        self.pending = True

    def reduce(self, *, sync: bool, async_op: bool) -> None:
        """Post-backward: reduce the gradients (``sync``) or keep accumulating them locally."""
        reduction = self._reduction
        if reduction is None or reduction.kind == "none":
            return
        if reduction.kind == "full":
            self._reduce_full(reduction, sync=sync, async_op=async_op)
        else:
            self._reduce_compact(reduction, sync=sync, async_op=async_op)

    def _detach_unsharded_grads(self) -> None:
        # autograd's references go before the storage is released
        for param in self.unsharded_params():
            param.grad = None

    def _accumulator(self, like: DBuffer) -> DBuffer:
        if self.accum is None:
            self.accum = like.new_like(self.reduce_dtype)
            self.accum.shard.untyped_storage().resize_(0)
        if not self.accum_pending:
            self.accum.alloc_unsharded(zero=True)
        return self.accum

    def _reduce_full(self, reduction: _Reduction, *, sync: bool, async_op: bool) -> None:
        if not (self.pending or self.accum_pending):
            return
        # no-sync accumulation runs in reduce_dtype (FSDP2): a compute-dtype microbatch gradient
        # is added into a reduce_dtype accumulator and the compute buffer is let go
        separate = self.reduce_dtype != self.compute_dtype
        if self.pending and (self.accum_pending or (separate and not sync)):
            self._copy_in()
            accum = self._accumulator(self.unsharded_grads)
            accum.unsharded_flat().add_(self.unsharded_grads.unsharded_flat())
            self._detach_unsharded_grads()
            self.unsharded_grads.reshard()
            self.pending, self.accum_pending = False, True
        if not sync:
            return  # same dtype: autograd keeps accumulating into the unsharded views
        source = self.accum if self.accum_pending else self.unsharded_grads
        assert source is not None
        if not self.accum_pending:
            self._copy_in()
        self._detach_unsharded_grads()
        self._issue_reduction(reduction, source, async_op=async_op)
        self.pending = self.accum_pending = False

    def _copy_in(self) -> None:
        """[Note: Shard(d) groups]: the unsharded gradient into chunk-major order, the
        reduce-scatter's input."""
        if not self.copies:
            return
        grad = self.unsharded_params()[0].grad
        assert grad is not None and self.shard_dim is not None
        self.unsharded_grads.alloc_unsharded()
        flat = self.unsharded_grads.unsharded_flat()
        with torch.no_grad():
            to_chunk_major(grad, flat, self.shard_dim, self.world)

    def _reduce_compact(self, reduction: _Reduction, *, sync: bool, async_op: bool) -> None:
        if self.pending:
            accum = self._compact_input(reduction)
            rows = accum.unsharded_flat().view(self.world, reduction.segment)
            with torch.no_grad():
                for rank, pieces in enumerate(reduction.pieces):
                    for i, start, length, dst in pieces:
                        grad = self.unsharded_params()[i].grad
                        if grad is not None:
                            self._used[i] = True
                        if grad is None or not length:
                            continue
                        local = grad._local_tensor if isinstance(grad, DTensor) else grad
                        flat = local.reshape(-1)[start : start + length]
                        rows[rank, dst : dst + length].add_(flat)
            self._detach_unsharded_grads()
            self.pending, self.accum_pending = False, True
        if not sync or not self.accum_pending:
            return
        assert self.accum is not None
        self._issue_reduction(reduction, self.accum, async_op=async_op)
        self.accum_pending = False

    def _compact_input(self, reduction: _Reduction) -> DBuffer:
        """The compact reduce-scatter input (reduce dtype, ``world`` segments), zeroed once."""
        if self.accum is None:
            total = reduction.segment * self.world
            layout = contiguous_layout([total], self.world, align=1)
            self.accum = DBuffer(
                layout,
                [(total,)],
                self.mesh,
                dtype=self.reduce_dtype,
                names=["trainable gradients"],
                shard_axis=self.shard_axis,
                check=False,
            )
            self.accum.shard.untyped_storage().resize_(0)
        if not self.accum_pending:
            self.accum.alloc_unsharded(zero=True)
        return self.accum

    def _issue_reduction(self, reduction: _Reduction, source: DBuffer, *, async_op: bool) -> None:
        """One reduce-scatter (plus one all-reduce per replicate axis for HSDP) of ``source``
        into the sharded gradient storage; each trainable parameter's ``.grad`` becomes its view."""
        views = self._sharded_grad_views(reduction)
        existing = [p.grad for p in self.sharded]
        accumulate = any(
            g is not None for g, v in zip(existing, views, strict=True) if v is not None
        )
        grads = self.grads
        assert grads is not None
        if accumulate:
            for i, (grad, view) in enumerate(zip(existing, views, strict=True)):
                if view is None:
                    continue
                if grad is None:
                    view._local_tensor.zero_()
                elif not _is_view_of(grad, view._local_tensor):
                    raise RuntimeError(
                        f"parameter {self.refs[i].fqn!r}: .grad was replaced by a tensor that "
                        "is not the engine's gradient storage; use zero_grad() or accumulate "
                        "into it in place"
                    )
        op: Literal["sum", "avg"] = "avg"
        if self.divide_factor is not None:
            source.scale_(1.0 / self.divide_factor, part="unsharded")
            op = "sum"
        if self.single_rank:
            self._reduce_locally(source, grads, accumulate=accumulate)
        elif self.all_reduce_hook is not None or self.custom_reduce_scatter is not None:
            self._reduce_with_user_hooks(source, grads, op, accumulate=accumulate)
        else:
            self.reduce_handle = source.reduce_scatter(
                op=op,
                reduce_dtype=self.reduce_dtype,
                accumulate=accumulate,
                into=grads,
                free_unsharded=True,
                async_op=async_op,
            )
        for param, view in zip(self.sharded, views, strict=True):
            if view is not None:
                param.grad = view
        if self.exact_presence:
            self._presence_due = [g is not None for g in existing]
        self._hooks_due = True
        if self.reduce_handle is None:
            self._run_post_accumulate_hooks()

    def _reduce_locally(self, source: DBuffer, grads: DBuffer, *, accumulate: bool) -> None:
        """One rank: the reduce-scatter is the identity, so no collective is issued."""
        flat = source.unsharded_flat()
        with torch.no_grad():
            if accumulate:
                grads.shard.add_(flat)
            else:
                grads.shard.copy_(flat)
        source.reshard()

    def _reduce_with_user_hooks(
        self, source: DBuffer, grads: DBuffer, op: Literal["sum", "avg"], *, accumulate: bool
    ) -> None:
        """``set_custom_reduce_scatter`` / ``set_all_reduce_hook``: reduce into a reduce-dtype
        shard, let the hook see it (after the HSDP all-reduce, like FSDP2), then write it."""
        out = source.new_like(self.reduce_dtype)
        if self.custom_reduce_scatter is not None:
            group = self.mesh.get_group(self.shard_axis)
            inp = source.unsharded_flat()
            if inp.dtype != self.reduce_dtype:
                inp = inp.to(self.reduce_dtype)
            work = self.custom_reduce_scatter(
                output_tensor=out.shard,
                input_tensor=inp,
                group=group,
                op=dist.ReduceOp.SUM,
                async_op=False,
            )
            if work is not None:
                work.wait()
            for axis in source.replicate_axes:
                dist.all_reduce(out.shard, group=self.mesh.get_group(axis))
            if op == "avg":
                out.shard.div_(self.mesh.size())
            source.reshard()
        else:
            source.reduce_scatter(
                op=op, reduce_dtype=self.reduce_dtype, into=out, free_unsharded=True
            )
        if self.all_reduce_hook is not None:
            self.all_reduce_hook(out.shard)
        with torch.no_grad():
            if accumulate:
                grads.shard.add_(out.shard)
            else:
                grads.shard.copy_(out.shard)

    def _sharded_grad_views(self, reduction: _Reduction) -> list[DTensor | None]:
        """Each trainable parameter's sharded gradient (a DTensor view of the gradient storage,
        made with the storage); None for frozen parameters."""
        if self.grads is None or self._grad_views is None:
            if reduction.kind == "compact":
                layout = contiguous_layout([reduction.segment * self.world], self.world, align=1)
                grads = DBuffer(
                    layout,
                    [(reduction.segment * self.world,)],
                    self.mesh,
                    dtype=self.dtype,
                    names=["trainable gradients"],
                    shard_axis=self.shard_axis,
                    check=False,
                )
                views: list[DTensor | None] = [None] * len(self.refs)
                for i, _start, length, dst in reduction.pieces[self.params.rank]:
                    views[i] = self._grad_dtensor(i, grads.shard[dst : dst + length])
            else:
                grads = self.params.new_like(self.dtype)
                views = [
                    self._grad_dtensor(i, local) if rg else None
                    for i, (local, rg) in enumerate(
                        zip(grads.local_views(), reduction.mask, strict=True)
                    )
                ]
            self.grads, self._grad_views = grads, views
            # What the engine itself keeps over the storage; a generator, so that no container
            # of this frame holds the tensors while the claim counts them
            grads.claim_views(t for v in views if v is not None for t in (v, v._local_tensor))
        self.grads.alloc_shard()  # memory again after release_dropped_gradients (same views)
        return self._grad_views

    def _grad_dtensor(self, i: int, local: torch.Tensor) -> DTensor:
        """Parameter ``i``'s sharded gradient over ``local``: the sharded parameter's own spec
        (same shape, placements and dtype) when it has no tensor parallelism, so no per-rank
        check runs again (``from_local`` checks every rank's units)."""
        local = local.view(self._local_shape(i))
        spec = _dtensor(self.sharded[i])._spec
        meta = spec.tensor_meta
        if self.tp_specs[i] is None and meta is not None and meta.dtype == local.dtype:
            return DTensor(local, spec, requires_grad=False)  # type: ignore[no-untyped-call]
        return self._dtensor_of(i, local)

    def presence_flags(self) -> torch.Tensor | None:
        """Exact presence, before the all-reduce: 1 for each parameter this rank used (or that
        already had a ``.grad``), 0 otherwise; None when no reduction awaits its presence."""
        had = self._presence_due
        if had is None:
            return None
        used = [float(u or h) for u, h in zip(self._used, had, strict=True)]
        return torch.tensor(used, dtype=torch.float32, device=self.params.device)

    def apply_presence(self, used_anywhere: torch.Tensor) -> None:
        """[Note: gradient presence]
        Every trainable parameter is reduced (zeros where a rank did not use it), so values are
        right whatever each rank's data did, and by default every trainable parameter of a
        reduced group keeps a ``.grad``: the same presence on every rank by construction
        (FSDP2's ``set_reduce_scatter_unused_params(True)``). A parameter no rank used then has
        a zero gradient where one process would have none. With
        ``set_reduce_scatter_unused_params(False)`` the engine tells the two apart like DDP's
        ``find_unused_parameters``: the ranks' used-flags are summed by one small all-reduce
        per backward (``used_anywhere``) and parameters no rank used lose their ``.grad``."""
        self._presence_due = None
        for param, flag in zip(self.sharded, used_anywhere.tolist(), strict=True):
            if not flag:
                param.grad = None
        if self.reduce_handle is None:  # else wait_for_reduce runs them
            self._run_post_accumulate_hooks()

    def _run_post_accumulate_hooks(self) -> None:
        """Hooks registered on the sharded parameters (``register_post_accumulate_grad_hook``,
        e.g. an optimizer step in backward) run once their reduced gradient is ready."""
        if not self._hooks_due or self._presence_due is not None:
            return  # exact presence: the hooks wait for it (see apply_presence)
        self._hooks_due = False
        for param in self.sharded:
            hooks = getattr(param, "_post_accumulate_grad_hooks", None)
            if hooks and param.grad is not None:
                for hook in tuple(hooks.values()):
                    hook(param)

    def release_dropped_gradients(self) -> None:
        """Let the sharded gradient buffer go once no parameter's .grad refers to it."""
        if self.grads is None or self.pending or self.reduce_handle is not None:
            return
        if all(p.grad is None for p in self.sharded) and not self.grads.release_shard():
            # a view is still held (a user kept ``p.grad``): it keeps its storage, a new
            # buffer is made at the next reduction
            self.grads = None
            self._grad_views = None

    def wait_for_reduce(self) -> None:
        if self.reduce_handle is not None:
            self.reduce_handle.wait()
            self.reduce_handle = None
        self._run_post_accumulate_hooks()

    def discard_iteration(self) -> None:
        """Drop every in-flight collective and pending gradient (``reset_iter_state``)."""
        if self.unshard_handle is not None:
            self.unshard_handle.wait()
            self.unshard_handle = None
        if self.reduce_handle is not None:
            self.reduce_handle.wait()
            self.reduce_handle = None
        self._detach_unsharded_grads()
        self.unsharded_grads.reshard()
        if self.accum is not None:
            self.accum.reshard()
        self.pending = self.accum_pending = self._hooks_due = False
        self._presence_due = None
        self.reshard()


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


def _dtensor(param: nn.Parameter) -> DTensor:
    """A sharded parameter as the DTensor it is (nn.Parameter to the type checker)."""
    assert isinstance(param, DTensor)
    return param


# [Note: bit-cast storage]
# Collectives do not carry every dtype (gloo rejects float8). A group of such a dtype stores its
# buffer as the same bytes in an integer dtype of the same width: the collectives move those
# bytes, and every parameter view reinterprets them (``Tensor.view(dtype)``, no copy). Such a
# group is not cast to ``param_dtype`` and cannot reduce gradients.
_BITCAST = {
    dtype: torch.uint8
    for dtype in (
        getattr(torch, name, None)
        for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    )
    if dtype is not None
}


def _event_now(device: torch.device) -> torch.Event | None:
    """An event marking how far ``device``'s current stream has got (None on CPU)."""
    if device.type in {"cpu", "meta"}:
        return None
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    return event


def _storage_dtype(dtype: torch.dtype) -> torch.dtype:
    return _BITCAST.get(dtype, dtype)


def _is_view_of(tensor: torch.Tensor, local: torch.Tensor) -> bool:
    inner = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    return bool(
        inner.untyped_storage().data_ptr() == local.untyped_storage().data_ptr()
        and inner.storage_offset() == local.storage_offset()
    )
