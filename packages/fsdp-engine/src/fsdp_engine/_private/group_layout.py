"""Laying out a group: the block each parameter keeps whole, the quantized all-gather's choice,
the plan (or FSDP2's placed layout), the storage, and the initial values in it."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_engine._private.api import BlockPolicy, MixedPrecisionPolicy
from fsdp_engine._private.param import FSDPParam, ParamRef, tp_spec
from fsdp_engine._private.placed import placed_layout
from fsdp_engine._private.plans import alignment, build_plan, view_dtypes
from fsdp_engine._private.quantized_gather import (
    QuantizedGather,
    TileAlignedBlocks,
    quantized_gather,
    select_quantized,
)
from fsdp_engine._private.spmd import SpmdMesh
from fsdp_engine._private.storage import ShardStorage
from fsdp_engine._private.subclass import SubclassWrap, plain_values, subclass_wrap

__all__ = ["GroupLayout", "lay_out_group"]


@attrs.frozen
class GroupLayout:
    """A laid-out group: its storage (holding the initial values), the quantized all-gather
    (None: plain), and its parameters, registered sharded."""

    storage: ShardStorage
    quantized: QuantizedGather | None
    params: tuple[FSDPParam, ...]


def lay_out_group(
    refs: Sequence[ParamRef],
    mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy,
    block_policy: BlockPolicy | None,
    shard_axis: int,
    device: torch.device,
    planner: str = "auto",
    shard_dims: Sequence[int] | None = None,
    spmd: SpmdMesh | None = None,
) -> GroupLayout:
    """Lay out ``refs`` (parameters of one dtype) on ``mesh``: planned (zero-copy
    ``RaggedShard`` views), or with ``shard_dims`` FSDP2's layout of parameters placed on
    ``Shard(d)`` ([Note: placed groups])."""
    registered = [r.registered() for r in refs]
    # Parameters already distributed by tensor/expert parallelism: the group holds their
    # local shards, and RaggedShard on the data-parallel axis cuts those (innermost).
    tp_specs = [tp_spec(r, p, mesh, spmd) for r, p in zip(refs, registered, strict=True)]
    # [Note: subclass parameters]: the subclass is kept on the local tensor, its values held here
    wraps: list[SubclassWrap | None] = [
        subclass_wrap(r.fqn, p) for r, p in zip(refs, registered, strict=True)
    ]
    # [Note: subclasses with a storage of their own]: a slot of the shape, the values elsewhere
    originals = [
        p.to_local()
        if isinstance(p, DTensor)
        else torch.empty(p.shape, dtype=p.dtype, device="meta")
        if w is not None and w.owns_storage
        else plain_values(p)
        for p, w in zip(registered, wraps, strict=True)
    ]
    real = [
        p.is_meta if w is not None and w.owns_storage else o.is_meta
        for p, o, w in zip(registered, originals, wraps, strict=True)
    ]
    dtypes = {p.dtype for p in originals}
    if len(dtypes) != 1:  # the caller splits a call's parameters by dtype
        raise ValueError(f"a group holds one dtype, got {sorted(map(str, dtypes))}")
    dtype = dtypes.pop()
    world = mesh.size(shard_axis)
    names = [r.fqn for r in refs]
    shapes = [tuple(p.shape) for p in originals]
    aligned = view_dtypes(dtype, mp_policy.param_dtype, mp_policy.reduce_dtype)
    # [Note: quantized all-gather of a group]: the chosen weights' shares are whole blocks
    quantization = mp_policy.quantized_all_gather
    selected = select_quantized(quantization, names, registered)
    placed = None
    subclassed = [n for n, w in zip(names, wraps, strict=True) if w is not None]
    if subclassed and shard_dims is None:  # fully_shard places them: a caller's mistake
        raise AssertionError(f"subclass parameters {subclassed} must be in a placed group")
    if shard_dims is not None:
        refused = [
            n
            for n, t, q in zip(names, tp_specs, selected, strict=True)
            if q or (t is not None and spmd is not None)
        ]
        if refused:
            raise NotImplementedError(
                f"fully_shard: shard_placement_fn placed {refused} on Shard(d); placements are "
                "supported for plain and tensor-parallel parameters (not with a quantized "
                "all-gather, not on an SPMD mesh of dp_mesh_dims)"
            )
        placed = placed_layout(shapes, shard_dims, world, alignment(aligned))
        plan = placed.plan(f"Shard(d) parameters {names}")
    else:
        if quantization is not None and any(selected):
            chosen = frozenset(n for n, q in zip(names, selected, strict=True) if q)
            block_policy = TileAlignedBlocks(quantization, chosen, block_policy)
        plan = build_plan(names, originals, world, block_policy, aligned, planner)
    meta = all(real)  # [Note: meta-device parameters]
    storage = ShardStorage(
        plan,
        names,
        shapes,
        mesh,
        dtype=dtype,
        shard_axis=shard_axis,
        device=device,
        tp_specs=tp_specs,
        placed=placed,
        meta=meta,
    )
    quantized = quantized_gather(quantization, storage.buffer, selected)
    if not meta:
        for i, p in enumerate(originals):
            if not p.is_meta:
                storage.load_full(i, p.detach().to(storage.device))
    params = tuple(
        FSDPParam(ref, i, storage, meta=m, requires_grad=p.requires_grad, wrap=w, value=p)
        for i, (ref, m, p, w) in enumerate(zip(refs, real, registered, wraps, strict=True))
    )
    return GroupLayout(storage, quantized, params)
