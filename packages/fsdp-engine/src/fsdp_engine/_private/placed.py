"""FSDP2's layout for the parameters ``shard_placement_fn`` places on ``Shard(d)``.

[Note: placed groups]
The parameters of one ``fully_shard`` call (of one dtype) that ``shard_placement_fn`` puts on
``Shard(d)`` share one group laid out as FSDP2 lays out a call's parameters, so each sharded
parameter is a plain DTensor with FSDP2's placement, shape and local tensor, and the call still
makes one all-gather and one reduce-scatter for them:

- every rank's shard holds, for each parameter ``i`` at offset ``o_i``, its chunk ``r`` along
  dim ``d_i``: ``ceil(D / m)`` rows for ``d = 0`` (DTensor's chunking: the last ranks may hold
  fewer rows or none, their chunk padded), ``D / m`` for ``d > 0`` (FSDP2 refuses an uneven
  ``d > 0``, and so do we), flattened row-major, i.e. ``X.reshape(pre, m, c, post)[:, r]``;
- so the gathered buffer is rank-major: ``[rank 0: chunk 0 of every parameter, rank 1: ...]``,
  and no strided view maps it onto a parameter's own order (index ``k`` of dim ``d`` lands in
  rank ``k // c`` at ``k % c``, rank blocks ``S`` apart), so each unsharded parameter is a
  separate tensor filled by one copy after the all-gather, and its gradient is copied back into
  this order before the reduce-scatter: FSDP2's copy-out and copy-in (``chunk_cat``), for
  these parameters only. The copies are a constant number of kernels per parameter, whatever
  the world size.
- A tensor-parallel parameter (a DTensor) is laid out by its local tensor, as FSDP2 does: the
  data-parallel ranks split the tensor-parallel shard along dim ``d``. Its sharded DTensor is on
  the data-parallel and tensor-parallel meshes together, with FSDP2's placements: ``Shard(d)``
  on the shard axis, or ``_StridedShard(d, k)`` where tensor parallelism also cuts dim ``d``
  into ``k`` parts (``placed_tp_dtensor``), and its gradient's local tensor is what the
  reduce-scatter input takes in.
- One parameter on ``Shard(0)`` alone is the exception: its chunks follow each other in the
  gathered buffer (``S = ceil(D / m) * R``, padding only at the end), which is the parameter in
  row-major order, so its unsharded parameter stays a view (zero-copy, like a planned group).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from fsdp_engine._private import compat, compat_fsdp2
from shard_planner import Plan

if TYPE_CHECKING:
    from fsdp_engine._private.param import TPSpec

__all__ = ["PlacedLayout", "placed_layout", "placed_tp_dtensor"]


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@attrs.frozen
class PlacedLayout:
    """The placed parameters' chunks in every rank's shard (module Note)."""

    world: int
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    chunks: tuple[int, ...]  # each parameter's per-rank numel (padded rows for d = 0)
    offsets: tuple[int, ...]  # where each parameter's chunk starts in every rank's shard
    shard_size: int

    @property
    def zero_copy(self) -> bool:
        """The unsharded parameters are views of the gathered buffer (one ``Shard(0)``)."""
        return self.world == 1 or (len(self.shapes) == 1 and self.dims[0] == 0)

    def _split(self, i: int) -> tuple[int, int, int]:
        """``(pre, c, post)``: the sizes before dim ``d_i``, one chunk of it, after it."""
        shape, dim = self.shapes[i], self.dims[i]
        size = shape[dim]
        c = -(-size // self.world) if dim == 0 else size // self.world
        return math.prod(shape[:dim]), c, math.prod(shape[dim + 1 :])

    def local_shape(self, i: int, rank: int) -> tuple[int, ...]:
        """``Shard(d_i)``'s local tensor shape on ``rank``."""
        shape, dim = self.shapes[i], self.dims[i]
        _, c, _ = self._split(i)
        if dim == 0:
            rows = max(0, min(c, shape[0] - rank * c))
            return (rows, *shape[1:])
        return (*shape[:dim], c, *shape[dim + 1 :])

    def local_numel(self, i: int, rank: int) -> int:
        return math.prod(self.local_shape(i, rank))

    def part_of_full(self, i: int, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of parameter ``i``'s full value, flat."""
        pre, c, post = self._split(i)
        if self.dims[i] == 0:
            start = rank * c * post
            return full.reshape(-1)[start : start + self.local_numel(i, rank)]
        return full.reshape(pre, self.world, c, post)[:, rank].reshape(-1)

    def _gathered(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s chunks in the gathered ``flat``: ``(m, chunk)``, rank blocks
        ``S`` apart."""
        off = self.offsets[i]
        return flat.view(self.world, self.shard_size)[:, off : off + self.chunks[i]]

    def copy_out(self, flat: torch.Tensor, i: int, out: torch.Tensor) -> None:
        """Parameter ``i``'s full value (``out``, its own shape) from the gathered ``flat``."""
        self.copy_out_rows(self._gathered(flat, i), i, out)

    def copy_out_rows(self, src: torch.Tensor, i: int, out: torch.Tensor) -> None:
        """Parameter ``i``'s full value (``out``) from its gathered chunks ``src``: ``(m,
        chunk)``, row ``r`` rank ``r``'s padded chunk (any row stride)."""
        pre, c, post = self._split(i)
        if self.dims[i] == 0:
            rows = self.shapes[i][0]
            full, tail = divmod(rows, c)
            flat_out = out.view(-1)
            src3 = src.view(self.world, c, post)
            flat_out[: full * c * post].view(full, c, post).copy_(src3[:full])
            if tail:
                flat_out[full * c * post :].view(tail, post).copy_(src3[full, :tail])
            return
        out.view(pre, self.world, c, post).copy_(src.view(self.world, pre, c, post).transpose(0, 1))

    def copy_in(
        self, grad: torch.Tensor, i: int, flat: torch.Tensor, *, accumulate: bool = False
    ) -> None:
        """Parameter ``i``'s full gradient into the zeroed reduce-scatter input ``flat`` (added
        to what is there with ``accumulate``; cast to ``flat``'s dtype)."""
        if isinstance(grad, DTensor):  # tensor parallel: its local tensor is what we laid out
            grad = compat.local_tensor(grad)
        pre, c, post = self._split(i)
        dst = self._gathered(flat, i)
        if self.dims[i] == 0:
            rows = self.shapes[i][0]
            full, tail = divmod(rows, c)
            grad_flat = grad.reshape(-1)
            dst3 = dst.view(self.world, c, post)
            head = grad_flat[: full * c * post].view(full, c, post)
            rest = grad_flat[full * c * post :].view(tail, post) if tail else None
            if accumulate:
                dst3[:full].add_(head)
                if rest is not None:
                    dst3[full, :tail].add_(rest)
            else:
                dst3[:full].copy_(head)
                if rest is not None:
                    dst3[full, :tail].copy_(rest)
            return
        chunks = grad.reshape(pre, self.world, c, post).transpose(0, 1)
        target = dst.view(self.world, pre, c, post)
        if accumulate:
            target.add_(chunks)
        else:
            target.copy_(chunks)

    def plan(self, name: str) -> Plan:
        """The buffer's layout: one flat pseudo-tensor of ``m * S`` elements, rank ``r``'s shard
        its ``r``-th block (dbuffer needs no more: the engine views the parameters in it)."""
        total = self.shard_size * self.world
        return Plan(
            world_size=self.world,
            shard_size=self.shard_size,
            align=1,
            numels=(total,),
            blocks=(self.shard_size,),
            names=(name,),
            offsets=(0,),
            order=(0,),
            method="fsdp2-placed",
        )


def placed_layout(
    shapes: Sequence[tuple[int, ...]], dims: Sequence[int], world: int, align: int
) -> PlacedLayout:
    """FSDP2's layout of parameters of ``shapes`` on ``Shard(dims[i])`` over ``world`` ranks,
    each chunk starting at a multiple of ``align`` elements (16 bytes in every dtype the
    buffer is viewed in), except for one ``Shard(0)`` parameter alone (zero-copy)."""
    chunks = []
    for shape, dim in zip(shapes, dims, strict=True):
        size = shape[dim] if shape else 1
        if dim > 0 and size % world:
            raise ValueError(f"dim {dim} of shape {shape} does not split into {world} equal chunks")
        per_rank = -(-size // world) if dim == 0 else size // world
        chunks.append(per_rank * math.prod(shape[:dim]) * math.prod(shape[dim + 1 :]))
    if len(shapes) == 1 and dims[0] == 0:
        return PlacedLayout(
            world, tuple(shapes), tuple(dims), (chunks[0],), (0,), max(1, chunks[0])
        )
    offsets, cursor = [], 0
    for chunk in chunks:
        offsets.append(cursor)
        cursor = _round_up(cursor + chunk, align)
    return PlacedLayout(
        world, tuple(shapes), tuple(dims), tuple(chunks), tuple(offsets), max(align, cursor)
    )


def placed_tp_dtensor(local: torch.Tensor, dp_mesh: DeviceMesh, dim: int, tp: TPSpec) -> DTensor:
    """The sharded DTensor of a tensor-parallel parameter placed on ``Shard(dim)`` (module
    Note): on the data-parallel and tensor-parallel meshes, FSDP2's placements (``Replicate``
    on HSDP's replicate axis)."""
    split = math.prod(
        tp.mesh.size(axis)
        for axis, placement in enumerate(tp.placements)
        if compat_fsdp2.is_shard_like(placement, dim)
    )
    shard: Placement = compat_fsdp2.strided_shard(dim, split) if split > 1 else Shard(dim)
    dp = [*(Replicate() for _ in range(dp_mesh.ndim - 1)), shard]
    return DTensor.from_local(
        local,
        tp.spmd_mesh,
        tp.sharded_placements(dp),
        run_check=False,
        shape=tp.shape,
        stride=tp.stride,
    )
