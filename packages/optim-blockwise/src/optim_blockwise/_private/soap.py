"""SOAP (Adam in the eigenbasis of Shampoo's preconditioner), tile by tile, sharded or not.

[Note: the SOAP variant]
The original SOAP (Vyas et al., 2024; its reference code, also pytorch-optimizer's ``SOAP``),
applied to every tile ``G`` of a matrix (``tiles.py``), at the parameter's ``k``-th Adam step:

- step 1 only accumulates the statistics and takes the first eigenbases
  ``Q_L, Q_R = eigh(GG_L), eigh(GG_R)`` (so the projection never uses the gradient it projects);
  the parameter does not move. This is SOAP's only ``eigh``, the one host sync (on CUDA) it
  keeps (``roots``' note on it); later refreshes use QR;
- ``G' = Q_L^T G Q_R``; ``M <- lerp(M, G, 1-b1)`` (in the original coordinates);
  ``V <- lerp(V, G'^2, 1-b2)`` (in the rotated ones);
  ``U = Q_L (Q_L^T M Q_R / (sqrt(V) + eps)) Q_R^T``;
- ``W <- W - lr sqrt(1-b2^k)/(1-b1^k) U``, then ``W <- W (1 - lr wd)`` (the original's order);
- ``GG_L <- lerp(GG_L, G G^T, 1-s)``, ``GG_R <- lerp(GG_R, G^T G, 1-s)`` (``s = shampoo_beta``,
  default ``b2``); every ``precondition_frequency`` Adam steps the eigenbases are refreshed by
  one power iteration and QR, ``V`` re-ordered with them (``roots.py``).

The tile's math is the original's op for op (``tensordot`` projections, ``lerp``), so a tile
equal to the whole matrix reproduces pytorch-optimizer's ``SOAP`` state bit for bit (tested).
Where it differs: a dimension larger than ``max_preconditioner_dim`` is tiled (the original
leaves that side unrotated); tensors of 3+ dims are one ``shape[0] x rest`` matrix (the original
rotates every dim); ``normalize_grads`` and ``merge_dims`` are not offered. Tensors below 2 dims
(and groups with ``use_preconditioner=False``) take the original's unrotated Adam (also with
step 1 skipped), elementwise with correctly rounded ops (``mul`` / ``add`` instead of ``lerp``,
so that any sharding gives the same bits).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch

from optim_blockwise._private.layout import local_flat
from optim_blockwise._private.precond_plan import BlockItem, StateSpec, as_dtype, dtype_name
from optim_blockwise._private.preconditioner import BlockPreconditioner
from optim_blockwise._private.roots import (
    first_eigenbasis,
    project,
    project_back,
    refresh_eigenbasis,
)
from optim_blockwise._private.tiles import Tile
from optim_blockwise._private.validate import check_betas, check_nonnegative

__all__ = ["SOAP"]


class SOAP(BlockPreconditioner):
    """SOAP: Adam in Shampoo's eigenbasis, per tile of at most ``max_preconditioner_dim``.

    See the module note for the algorithm and how it relates to the original. Defaults are the
    original's (``lr=3e-3, betas=(0.95, 0.95), weight_decay=0.01, precondition_frequency=10``).
    ``preconditioner_dtype`` (float32 or float64) holds the statistics and eigenbases.
    Parameters may be plain tensors, ``RaggedShard`` DTensors or FSDP2 ``Shard(0)`` DTensors; see
    ``SOAP.block_policy`` to keep every tile whole on one rank.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        shampoo_beta: float | None = None,
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        max_preconditioner_dim: int = 1024,
        *,
        correct_bias: bool = True,
        preconditioner_dtype: torch.dtype | str = torch.float32,
        use_preconditioner: bool | None = None,
    ) -> None:
        check_nonnegative("lr", lr)
        check_betas("betas", betas)
        if shampoo_beta is not None and not (
            isinstance(shampoo_beta, int | float)
            and math.isfinite(shampoo_beta)
            and 0.0 <= shampoo_beta < 1.0
        ):
            raise ValueError(f"shampoo_beta must be None or in [0, 1), got {shampoo_beta}")
        check_nonnegative("eps", eps)
        check_nonnegative("weight_decay", weight_decay)
        for name, value in (
            ("precondition_frequency", precondition_frequency),
            ("max_preconditioner_dim", max_preconditioner_dim),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "shampoo_beta": shampoo_beta,
            "eps": eps,
            "weight_decay": weight_decay,
            "precondition_frequency": precondition_frequency,
            "max_preconditioner_dim": max_preconditioner_dim,
            "correct_bias": correct_bias,
            "preconditioner_dtype": dtype_name(preconditioner_dtype, "preconditioner_dtype"),
            "use_preconditioner": use_preconditioner,
        }
        super().__init__(params, defaults)

    # -- tiles (on their owner) ----------------------------------------------------------------
    def _block_spec(self, group: dict[str, Any], tile: Tile) -> StateSpec:
        pd = as_dtype(group["preconditioner_dtype"])
        h, w = tile.shape
        return {
            "exp_avg": ((h, w), torch.float32),
            "exp_avg_sq": ((h, w), torch.float32),
            "GG_L": ((h, h), pd),
            "GG_R": ((w, w), pd),
            "Q_L": ((h, h), pd),
            "Q_R": ((w, w), pd),
        }

    def _statistics(
        self, group: dict[str, Any], state: dict[str, torch.Tensor], g: torch.Tensor
    ) -> None:
        beta = group["shampoo_beta"]
        beta = group["betas"][1] if beta is None else beta
        for key, dims in (("GG_L", [[1], [1]]), ("GG_R", [[0], [0]])):
            outer = torch.tensordot(g, g, dims=dims)
            state[key].lerp_(outer.to(state[key].dtype), weight=1.0 - beta)

    def _direction(
        self, group: dict[str, Any], state: dict[str, torch.Tensor], grad: torch.Tensor, step: int
    ) -> torch.Tensor:
        pd = as_dtype(group["preconditioner_dtype"])
        if step == 1:
            self._statistics(group, state, grad)
            for side in ("L", "R"):
                # not finite: the identity, i.e. plain Adam on this side
                state[f"Q_{side}"], failed = first_eigenbasis(state[f"GG_{side}"])
                self._note_fallback(failed)
            return torch.zeros_like(grad)
        beta1, beta2 = group["betas"]
        left, right = state["Q_L"], state["Q_R"]
        g = grad.to(pd)
        rotated = project(g, left, right)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        exp_avg.lerp_(grad, weight=1.0 - beta1)
        exp_avg_sq.lerp_(rotated.square().to(exp_avg_sq.dtype), weight=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        moment = project(exp_avg.to(pd), left, right)
        update = project_back((moment / denom.to(pd)), left, right).to(torch.float32)
        self._statistics(group, state, grad)
        k = step - 1
        if k % group["precondition_frequency"] == 0:
            for side, dim in (("L", 0), ("R", 1)):
                state[f"Q_{side}"], state["exp_avg_sq"], failed = refresh_eigenbasis(
                    state[f"GG_{side}"], state[f"Q_{side}"], state["exp_avg_sq"], dim
                )
                self._note_fallback(failed)
        return update

    def _restore_layout(self, name: str, value: torch.Tensor) -> torch.Tensor:
        # eigh and QR return column-major bases (LAPACK): keep them so after a reload too.
        return value.t().contiguous().t() if name in ("Q_L", "Q_R") else value

    # -- this rank's elements ------------------------------------------------------------------
    @staticmethod
    def _step_size(group: dict[str, Any], k: int) -> float:
        beta1, beta2 = group["betas"]
        step_size: float = group["lr"]
        if group["correct_bias"]:
            step_size *= math.sqrt(1.0 - beta2**k) / (1.0 - beta1**k)
        return step_size

    def _apply(self, item: BlockItem, update: torch.Tensor, step: int) -> None:
        p = local_flat(item.param, item.name)
        if step == 1 or p.numel() == 0:
            return
        lr, wd = item.group["lr"], item.group["weight_decay"]
        p32 = p if p.dtype == torch.float32 else p.float()
        p32.sub_(update * self._step_size(item.group, step - 1))
        if wd:
            p32.mul_(1.0 - wd * lr)
        if p32 is not p:
            p.copy_(p32)

    def _elementwise(self, item: BlockItem, step: int) -> None:
        assert item.param.grad is not None
        grad = local_flat(item.param.grad, item.name).float()
        state = cast(dict[str, Any], self.state[item.param])
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        if step == 1:
            return
        beta1, beta2 = item.group["betas"]
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(grad * (1.0 - beta1))
        v.mul_(beta2).add_(grad * grad * (1.0 - beta2))
        self._apply(item, m / v.sqrt().add_(item.group["eps"]), step)
