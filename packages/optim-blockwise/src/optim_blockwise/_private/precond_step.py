"""The owner exchange of Shampoo/SOAP's cut tiles in one step (see ``preconditioner``'s notes):
gradient pieces to each tile's owner, the owner's update, this rank's pieces back."""

from __future__ import annotations

from collections.abc import Callable

import torch

from optim_blockwise._private import exchange
from optim_blockwise._private.layout import local_flat
from optim_blockwise._private.precond_plan import BlockItem
from optim_blockwise._private.tiles import read_piece, write_piece

__all__ = ["run_exchange"]


def run_exchange(
    units: tuple[tuple[BlockItem, int], ...],
    owner_exchange: exchange.OwnerExchange,
    grads: dict[torch.Tensor, torch.Tensor],
    steps: dict[torch.Tensor, int],
    updates: dict[torch.Tensor, torch.Tensor],
    tile_compute: Callable[[BlockItem, int, torch.Tensor, int], torch.Tensor],
    in_flight: int,
    overlap: Callable[[], None] | None = None,
) -> exchange.ExchangeStats:
    """One step of ``owner_exchange``: cut tiles' gradient pieces to their owners, each
    owner's ``tile_compute`` and this rank's pieces of the updates back into ``updates``."""

    def piece(i: int) -> torch.Tensor:
        return _piece(units[i], grads)

    def compute(bucket: exchange.Bucket, fulls: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        return {i: _owner_compute(units[i], full, steps, tile_compute) for i, full in fulls.items()}

    def apply(bucket: exchange.Bucket, pieces: dict[int, torch.Tensor]) -> None:
        _receive(units, pieces, updates)

    return owner_exchange.run(
        piece=piece,
        compute=compute,
        apply=apply,
        present=[item.param.grad is not None for item, _ in units],
        overlap=overlap,
        in_flight=in_flight,
    )


def _piece(unit: tuple[BlockItem, int], grads: dict[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """This rank's fp32 piece of a cut tile's gradient (zeros without a gradient)."""
    item, t = unit
    assert item.blocks is not None
    piece = item.blocks.pieces[t]
    grad = grads.get(item.param)
    if grad is None:
        device = local_flat(item.param, item.name).device
        return torch.zeros(piece.numel, dtype=torch.float32, device=device)
    return read_piece(grad, piece, torch.float32)


def _owner_compute(
    unit: tuple[BlockItem, int],
    full: torch.Tensor,
    steps: dict[torch.Tensor, int],
    tile_compute: Callable[[BlockItem, int, torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    item, t = unit
    if item.param not in steps:  # no gradient (on every rank, or the exchange raises)
        return torch.zeros_like(full)
    return tile_compute(item, t, full, steps[item.param])


def _receive(
    units: tuple[tuple[BlockItem, int], ...],
    pieces: dict[int, torch.Tensor],
    updates: dict[torch.Tensor, torch.Tensor],
) -> None:
    for i, back in pieces.items():
        item, t = units[i]
        if item.param in updates:
            assert item.blocks is not None
            write_piece(updates[item.param], item.blocks.pieces[t], back)
