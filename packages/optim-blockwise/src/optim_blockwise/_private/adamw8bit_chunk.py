"""``AdamW8bit``'s update of one run in chunks of whole blocks (see ``adamw8bit``'s notes on
bit-identical results and on runs, chunks and memory)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from optim_blockwise._private import quant
from optim_blockwise._private.adamw8bit_places import EIGHT_BIT_KEYS, FP32_KEYS, Item, Place
from optim_blockwise._private.layout import local_flat
from optim_blockwise._private.runs import Run, flat_view, local_of

__all__ = ["moments", "moments_into", "update_chunk", "update_run"]


def moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> None:
    """In place: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2`` (unfused, see Note)."""
    m.mul_(beta1).add_(g * (1.0 - beta1))
    v.mul_(beta2).add_(g.mul(g).mul_(1.0 - beta2))


def moments_into(
    m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float, tmp: torch.Tensor
) -> None:
    """``moments`` with its temporaries in ``tmp`` (scratch): the same ops, in the same order."""
    m.mul_(beta1).add_(torch.mul(g, 1.0 - beta1, out=tmp))
    v.mul_(beta2).add_(torch.mul(g, g, out=tmp).mul_(1.0 - beta2))


def update_run(
    run: Run,
    items: list[Item],
    places: list[Place],
    states: list[dict[str, Any]],
    edges: dict[int, tuple[torch.Tensor, torch.Tensor]],
    chunk: int,
    scratch: quant.Scratch,
    steps_done: float,
    run_views: Callable[[Place, int], dict[str, torch.Tensor]],
    block: int,
) -> int:
    """Update one run in chunks of whole blocks; returns the number of chunks."""
    first = items[run.members[0]]
    place = places[run.members[0]]
    group = first.group
    lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    step = steps_done + 1.0
    bias1 = 1.0 - beta1**step
    bias2_sqrt = math.sqrt(1.0 - beta2**step)
    assert first.param.grad is not None
    if len(run.members) == 1:
        p_all = local_flat(first.param, first.name)
        g_all = local_flat(first.param.grad, first.name)
        state = states[run.members[0]]
        views = {k: state[k] for k in (EIGHT_BIT_KEYS if place.eight_bit else FP32_KEYS)}
    else:
        p_all = flat_view(local_of(first.param), run.numel)
        g_all = flat_view(local_of(first.param.grad), run.numel)
        views = run_views(place, run.numel)
    head = place.head if place.eight_bit else 0
    edge = edges.get(run.members[0]) if len(run.members) == 1 else None
    n_total = run.numel
    lo, count = 0, 0
    while lo < n_total:
        # chunk boundaries on block boundaries of the run's grid
        if place.eight_bit:
            hi = min(n_total, ((head + lo + chunk) // block) * block - head)
        else:
            hi = min(n_total, lo + chunk)
        update_chunk(
            p_all[lo:hi],
            g_all[lo:hi],
            views,
            lo,
            hi,
            head,
            place.eight_bit,
            (beta1, beta2, lr, eps, wd, bias1, bias2_sqrt),
            scratch,
            edge,
            block,
            first_chunk=lo == 0,
            last_chunk=hi == n_total,
        )
        lo = hi
        count += 1
    return count


def update_chunk(
    p: torch.Tensor,
    g_in: torch.Tensor,
    views: dict[str, torch.Tensor],
    lo: int,
    hi: int,
    head: int,
    eight_bit: bool,
    hyper: tuple[float, ...],
    scratch: quant.Scratch,
    edge: tuple[torch.Tensor, torch.Tensor] | None,
    block: int,
    *,
    first_chunk: bool,
    last_chunk: bool,
) -> None:
    beta1, beta2, lr, eps, wd, bias1, bias2_sqrt = hyper
    n = hi - lo
    f = scratch.f
    p32 = p if p.dtype == torch.float32 else f[3][:n].copy_(p)
    g = g_in if g_in.dtype == torch.float32 else g_in.float()
    if eight_bit:
        h = head if first_chunk else 0
        b_lo = (head + lo) // block
        nb = -(-(h + n) // block)
        m_pad, v_pad = f[0][: nb * block], f[1][: nb * block]
        codes_m = views["exp_avg_codes"][lo:hi]
        codes_v = views["exp_avg_sq_codes"][lo:hi]
        abs_m = views["exp_avg_absmax"][b_lo : b_lo + nb]
        abs_v = views["exp_avg_sq_absmax"][b_lo : b_lo + nb]
        m = quant.dequantize_into(m_pad, codes_m, abs_m, block, h, True, scratch.i[0])
        v = quant.dequantize_into(v_pad, codes_v, abs_v, block, h, False, scratch.i[0])
    else:
        m = views["exp_avg"][lo:hi]
        v = views["exp_avg_sq"][lo:hi]
    p32.mul_(1.0 - lr * wd)
    denom = f[2][:n]
    moments_into(m, v, g, beta1, beta2, denom)
    torch.sqrt(v, out=denom)
    denom.div_(bias2_sqrt).add_(eps)
    torch.div(m, denom, out=denom)
    p32.sub_(denom.mul_(lr / bias1))
    if p32 is not p:
        p.copy_(p32)
    if not eight_bit:
        return
    quant.absmax_into(abs_m, m_pad, block, h, n, False, f[2])
    quant.absmax_into(abs_v, v_pad, block, h, n, True, f[2])
    if edge is not None:  # blocks shared with neighbouring ranks: the global absmax
        if first_chunk:
            abs_m[0], abs_v[0] = edge[0][0], edge[0][1]
        if last_chunk:
            abs_m[-1], abs_v[-1] = edge[1][0], edge[1][1]
    # v first: its buffer then serves as scratch for m's quantization
    quant.quantize_into(codes_v, v_pad, abs_v, block, h, False, scratch, f[2], f[3])
    quant.quantize_into(codes_m, m_pad, abs_m, block, h, True, scratch, f[2], f[1])
