"""Shampoo with Adam or SGD grafting, tile by tile, on plain tensors and sharded parameters.

[Note: the Shampoo variant]
Per tile ``G`` (``rows x cols`` of a matrix, see ``tiles.py``), at the parameter's step ``t``:

- statistics ``L <- b2 L + (1-b2) G G^T``, ``R <- b2 R + (1-b2) G^T G`` (``b2 = 1``: plain sums,
  Gupta et al.'s original);
- filtered gradient ``M <- b1 M + (1-b1) G``, ``M_hat = M / (1 - b1^t)`` (``b1 = 0``: ``G``);
- every ``precondition_frequency`` steps from ``start_preconditioning_step`` on, the inverse
  roots ``(L_hat + eps I)^(-1/4)`` and ``(R_hat + eps I)^(-1/4)`` of the bias-corrected statistics
  are recomputed in ``preconditioner_dtype`` (``roots.py``: eigendecomposition, eigenvalues
  clamped at ``eps``, float64 retry, the previous root kept on failure). Only these refresh
  steps call ``eigh``, the one host sync (on CUDA) the step keeps: see ``roots``' note on it;
- ``P = L^(-1/4) M_hat R^(-1/4)``;
- grafting (Anil et al.; Meta's distributed Shampoo): the step takes its direction from ``P`` and
  its size from a simpler method on the same tile, ``U = P ||A||_F / (||P||_F + 1e-16)`` with
  ``A = M_hat / (sqrt(V / (1 - bg^t)) + eps_g)`` (``"adam"``, ``V <- bg V + (1-bg) G^2``) or
  ``A = M_hat`` (``"sgd"``); ``"none"`` uses ``P`` as is. Before the first root, ``U = A``;
- ``W <- W (1 - lr wd) - lr U`` (decoupled weight decay: with Adam grafting, AdamW grafting).

Tensors below 2 dims (and groups with ``use_preconditioner=False``) take the grafting method
alone, elementwise. Checked against pytorch-optimizer's ``Shampoo`` (``grafting="none"``) and
``ScalableShampoo`` (SGD grafting) in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, cast

import torch

from optim_blockwise._private.layout import local_flat
from optim_blockwise._private.precond_plan import BlockItem, StateSpec, as_dtype, dtype_name
from optim_blockwise._private.preconditioner import BlockPreconditioner
from optim_blockwise._private.roots import refreshed_inverse_root
from optim_blockwise._private.tiles import Tile
from optim_blockwise._private.validate import check_nonnegative

__all__ = ["Shampoo"]

GRAFTINGS = ("adam", "sgd", "none")


def _check_unit(name: str, value: float, closed: bool = False) -> None:
    ok = isinstance(value, int | float) and math.isfinite(value) and value >= 0.0
    ok = ok and (value <= 1.0 if closed else value < 1.0)
    if not ok:
        raise ValueError(f"{name} must be in [0, 1{']' if closed else ')'}, got {value}")


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class Shampoo(BlockPreconditioner):
    """Shampoo (tiles of at most ``max_preconditioner_dim`` per side) with grafting.

    See the module note for the algorithm. ``betas = (b1, b2)``: ``b1`` filters the gradient,
    ``b2`` averages the statistics (1.0 sums them). ``grafting`` is ``"adam"`` (default),
    ``"sgd"`` or ``"none"``; ``grafting_beta2`` / ``grafting_epsilon`` configure Adam grafting.
    ``start_preconditioning_step`` defaults to ``precondition_frequency``. A param group's
    ``use_preconditioner`` (``None``: tensors of 2+ dims) selects the preconditioned path.

    Parameters may be plain tensors, ``RaggedShard`` DTensors or FSDP2 ``Shard(0)`` DTensors:
    each tile is computed once, on its owner (see ``Shampoo.block_policy`` to make every tile
    whole on one rank, so that nothing is exchanged). ``state_dict()`` gives DCP-reshardable
    state.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        epsilon: float = 1e-12,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 10,
        start_preconditioning_step: int | None = None,
        *,
        grafting: str = "adam",
        grafting_beta2: float = 0.999,
        grafting_epsilon: float = 1e-8,
        preconditioner_dtype: torch.dtype | str = torch.float32,
        use_preconditioner: bool | None = None,
    ) -> None:
        check_nonnegative("lr", lr)
        if len(betas) != 2:
            raise ValueError(f"betas must be two numbers, got {tuple(betas)}")
        _check_unit("betas[0]", betas[0])
        _check_unit("betas[1]", betas[1], closed=True)
        if not (isinstance(epsilon, int | float) and math.isfinite(epsilon) and epsilon > 0):
            raise ValueError(f"epsilon must be a finite number > 0, got {epsilon}")
        check_nonnegative("weight_decay", weight_decay)
        _check_positive_int("max_preconditioner_dim", max_preconditioner_dim)
        _check_positive_int("precondition_frequency", precondition_frequency)
        start = (
            precondition_frequency
            if start_preconditioning_step is None
            else (start_preconditioning_step)
        )
        _check_positive_int("start_preconditioning_step", start)
        if grafting not in GRAFTINGS:
            raise ValueError(f"grafting must be one of {GRAFTINGS}, got {grafting!r}")
        _check_unit("grafting_beta2", grafting_beta2)
        check_nonnegative("grafting_epsilon", grafting_epsilon)
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "epsilon": epsilon,
            "weight_decay": weight_decay,
            "max_preconditioner_dim": max_preconditioner_dim,
            "precondition_frequency": precondition_frequency,
            "start_preconditioning_step": start,
            "grafting": grafting,
            "grafting_beta2": grafting_beta2,
            "grafting_epsilon": grafting_epsilon,
            "preconditioner_dtype": dtype_name(preconditioner_dtype, "preconditioner_dtype"),
            "use_preconditioner": use_preconditioner,
        }
        super().__init__(params, defaults)

    # -- tiles (on their owner) ----------------------------------------------------------------
    def _block_spec(self, group: dict[str, Any], tile: Tile) -> StateSpec:
        pd = as_dtype(group["preconditioner_dtype"])
        h, w = tile.shape
        spec: StateSpec = {
            "L": ((h, h), pd),
            "R": ((w, w), pd),
            "L_inv_root": ((h, h), pd),
            "R_inv_root": ((w, w), pd),
        }
        if group["betas"][0] > 0:
            spec["exp_avg"] = ((h, w), torch.float32)
        if group["grafting"] == "adam":
            spec["exp_avg_sq"] = ((h, w), torch.float32)
        return spec

    def _init_block(
        self, group: dict[str, Any], tile: Tile, device: torch.device
    ) -> dict[str, Any]:
        state = super()._init_block(group, tile, device)
        for key in ("L_inv_root", "R_inv_root"):  # identity until the first root
            state[key] = torch.eye(state[key].shape[0], dtype=state[key].dtype, device=device)
        return state

    def _direction(
        self, group: dict[str, Any], state: dict[str, torch.Tensor], grad: torch.Tensor, step: int
    ) -> torch.Tensor:
        beta1, beta2 = group["betas"]
        pd = as_dtype(group["preconditioner_dtype"])
        g = grad.to(pd)
        for key, gram in (("L", g @ g.T), ("R", g.T @ g)):
            if beta2 == 1.0:
                state[key].add_(gram)
            else:
                state[key].mul_(beta2).add_(gram.mul_(1.0 - beta2))
        moment = self._filtered(state, grad, beta1, step)
        graft = self._graft(group, state, grad, moment, step)
        start, every = group["start_preconditioning_step"], group["precondition_frequency"]
        if step >= start and (step - start) % every == 0:
            correction = 1.0 if beta2 == 1.0 else 1.0 - beta2**step
            for key in ("L", "R"):
                stat = state[key] if correction == 1.0 else state[key] / correction
                state[f"{key}_inv_root"], failed = refreshed_inverse_root(
                    stat, 4.0, group["epsilon"], pd, state[f"{key}_inv_root"]
                )
                self._note_fallback(failed)
        if step < start:
            return graft
        precond = (state["L_inv_root"] @ moment.to(pd) @ state["R_inv_root"]).to(torch.float32)
        if group["grafting"] == "none":
            return precond
        return precond.mul_(
            torch.linalg.vector_norm(graft) / (torch.linalg.vector_norm(precond) + 1e-16)
        )

    @staticmethod
    def _filtered(
        state: dict[str, torch.Tensor], grad: torch.Tensor, beta1: float, step: int
    ) -> torch.Tensor:
        """``M_hat``: the bias-corrected EMA of the gradient (the gradient itself for b1 = 0)."""
        if beta1 == 0:
            return grad
        m = state["exp_avg"]
        m.mul_(beta1).add_(grad * (1.0 - beta1))
        return m / (1.0 - beta1**step)

    @staticmethod
    def _graft(
        group: dict[str, Any],
        state: dict[str, torch.Tensor],
        grad: torch.Tensor,
        moment: torch.Tensor,
        step: int,
    ) -> torch.Tensor:
        """The grafting method's update ``A`` (Adam: its second moment is updated here)."""
        if group["grafting"] != "adam":
            return moment
        beta = group["grafting_beta2"]
        v = state["exp_avg_sq"]
        v.mul_(beta).add_(grad * grad * (1.0 - beta))
        denom = (v / (1.0 - beta**step)).sqrt_().add_(group["grafting_epsilon"])
        out: torch.Tensor = moment / denom
        return out

    # -- this rank's elements ------------------------------------------------------------------
    def _apply(self, item: BlockItem, update: torch.Tensor, step: int) -> None:
        p = local_flat(item.param, item.name)
        if p.numel() == 0:
            return
        lr, wd = item.group["lr"], item.group["weight_decay"]
        p32 = p if p.dtype == torch.float32 else p.float()
        if wd:
            p32.mul_(1.0 - lr * wd)
        p32.sub_(update * lr)
        if p32 is not p:
            p.copy_(p32)

    def _elementwise(self, item: BlockItem, step: int) -> None:
        assert item.param.grad is not None
        group = item.group
        grad = local_flat(item.param.grad, item.name).float()
        state = cast(dict[str, Any], self.state[item.param])
        for key, needed in (
            ("exp_avg", group["betas"][0] > 0),
            ("exp_avg_sq", group["grafting"] == "adam"),
        ):
            if needed and key not in state:
                state[key] = torch.zeros_like(grad)
        moment = self._filtered(state, grad, group["betas"][0], step)
        self._apply(item, self._graft(group, state, grad, moment, step), step)
