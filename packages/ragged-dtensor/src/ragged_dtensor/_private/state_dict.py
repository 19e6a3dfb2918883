"""Full state dicts into ragged DTensors: torch's ``broadcast_from_rank0`` load path.

[Note: why torch's state-dict loader needs a hook]
``set_model_state_dict`` / ``set_optimizer_state_dict`` / ``set_state_dict`` with
``StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)`` (the FSDP2 tutorial's
pretrained-weight load, accelerate's and the transformers Trainer's ``FULL_STATE_DICT`` resume)
broadcast each full tensor from rank 0 and hand every ``(sharded DTensor, full tensor)`` pair to
``torch.distributed._state_dict_utils._distribute_tensors``. That function cuts the rank's share
as a *box*: ``full[slices]`` from ``compute_local_shape_and_global_offset``, which knows only
``Shard``/``_StridedShard`` (every other placement is "the whole dim"). Then it either builds a
new DTensor over that box (a meta destination) or ``copy_``s the box into ``to_local()``. A
RaggedShard share is a flat range of the box the other placements leave, so neither can be
expressed as ``full[slices]``: the meta path wraps the whole tensor as the "share" and the copy
path fails on the shapes. No placement hook is consulted on the way (``_split_tensor`` is not
called; ``from_local`` does not cut), so the integration wraps ``_distribute_tensors`` itself
(module attribute, looked up by name by its only caller ``_broadcast_tensors``): pairs whose
DTensor is ragged get their share here, every other pair goes to torch's function unchanged.
(``full_state_dict=True`` without the broadcast calls ``distribute_tensor``, which the
integration already routes: [Note: distribute_tensor's code].)

[Note: no temporary beyond the share]
The share is copied straight out of the full tensor: the box the standard placements leave is a
view, and a flat range of a (possibly strided) box is at most two partial rows around a run of
whole rows at every level, each copied into its place of the destination with ``copy_``. So a
destination that exists (after ``to_empty``) receives the share with no temporary at all, and a
meta destination gets exactly one new tensor of the share's size, as torch gives for Shard.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement, Replicate, _StridedShard

from ragged_dtensor._private.placement import RaggedShard
from ragged_dtensor._private.redistribute import ragged_axis

__all__ = ["copy_flat_range", "distribute_tensors_hook", "share_into"]


def copy_flat_range(dst: torch.Tensor, src: torch.Tensor, start: int, stop: int) -> None:
    """``dst.copy_(src.reshape(-1)[start:stop])`` without materialising ``src.reshape(-1)``.

    ``dst`` is a contiguous 1-D tensor of ``stop - start`` elements; ``src`` any strided tensor
    (a view of a larger one). The range splits over dim 0 into a partial first row, whole rows
    and a partial last row; whole rows are one ``copy_`` into ``dst`` viewed as those rows, a
    partial row recurses into that row.
    """
    if start >= stop:
        return
    if src.dim() == 0 or (start == 0 and stop == src.numel()):
        dst.view(src.shape).copy_(src)
        return
    row = src.numel() // src.shape[0]
    first, last = start // row, (stop - 1) // row
    if first == last:
        copy_flat_range(dst, src[first], start - first * row, stop - first * row)
        return
    pos = 0
    if start % row:
        head = (first + 1) * row - start
        copy_flat_range(dst[:head], src[first], start - first * row, row)
        pos, first = head, first + 1
    end_row = stop // row
    if end_row > first:
        n = (end_row - first) * row
        dst[pos : pos + n].view(end_row - first, *src.shape[1:]).copy_(src[first:end_row])
        pos += n
    if stop % row:
        copy_flat_range(dst[pos:], src[end_row], 0, stop - end_row * row)


def _strided(placements: tuple[Placement, ...]) -> bool:
    return any(isinstance(p, _StridedShard) for p in placements)


def share_into(full: torch.Tensor, spec: DTensorSpec, dst: torch.Tensor) -> None:
    """Copy this rank's share of ``full`` (laid out as ``spec``, which has a RaggedShard) into the
    contiguous 1-D ``dst`` ([Note: no temporary beyond the share])."""
    mesh, placements = spec.mesh, tuple(spec.placements)
    axis = ragged_axis(placements)
    assert axis is not None
    ragged = placements[axis]
    assert isinstance(ragged, RaggedShard)
    standard = tuple(Replicate() if i == axis else p for i, p in enumerate(placements))
    coordinate = mesh.get_local_rank(axis)
    if _strided(standard):
        # _StridedShard's share is not a slice of the full tensor: torch's own cut, then ours
        from ragged_dtensor._private.compat import torch_distribute

        box = torch_distribute(full, mesh, list(standard), src_data_rank=None).to_local()
    else:
        shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, standard)
        box = full[tuple(slice(o, o + s) for s, o in zip(shape, offset, strict=True))]
    flat = ragged.flat_range(tuple(box.shape), coordinate)
    if dst.numel() != flat.numel:
        raise RuntimeError(
            f"{ragged!r} on mesh axis {axis}: this rank's local tensor has {dst.numel()} "
            f"elements but its share of shape {tuple(full.shape)} has {flat.numel}"
        )
    if dst.is_contiguous():
        copy_flat_range(dst.view(-1), box, flat.start, flat.stop)
    else:
        tmp = torch.empty(flat.numel, dtype=dst.dtype, device=dst.device)
        copy_flat_range(tmp, box, flat.start, flat.stop)
        dst.copy_(tmp.view(dst.shape))


def _ragged_pair(value: object) -> tuple[DTensor, torch.Tensor] | None:
    if not (isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], DTensor)):
        return None
    if ragged_axis(value[0].placements) is None:
        return None
    return value[0], value[1]


def _load_one(key: str, local_state: DTensor, full: torch.Tensor) -> DTensor:
    if tuple(full.shape) != tuple(local_state.shape):
        raise RuntimeError(
            f"size mismatch for {key}: the full state dict holds shape {tuple(full.shape)}, the "
            f"sharded tensor ({local_state.placements}) has global shape "
            f"{tuple(local_state.shape)}"
        )
    if local_state.is_meta:
        # torch's Shard path gives a new local tensor of the full tensor's dtype and device
        spec = local_state._spec
        local = torch.empty(local_state.to_local().numel(), dtype=full.dtype, device=full.device)
        share_into(full.detach(), spec, local)
        meta = TensorMeta(local_state.shape, local_state.stride(), full.dtype)
        new_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)
        return DTensor(local, new_spec, requires_grad=False)  # type: ignore[no-untyped-call]
    share_into(full.detach(), local_state._spec, local_state.to_local())
    return local_state


def distribute_tensors_hook(
    original: Callable[..., None],
    local_state_dict: dict[str, Any],
    keys: list[str],
    device: torch.device,
    pg: Any = None,
) -> None:
    """torch's ``_distribute_tensors`` with ragged DTensors cut here ([Note: why torch's
    state-dict loader needs a hook]); the other keys go to torch's function unchanged."""
    rest = []
    for key in keys:
        pair = _ragged_pair(local_state_dict.get(key))
        if pair is None:
            rest.append(key)
            continue
        local_state_dict[key] = _load_one(key, *pair)
    if rest:
        original(local_state_dict, rest, device, pg)
