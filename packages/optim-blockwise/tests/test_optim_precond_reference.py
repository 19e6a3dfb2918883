"""Shampoo and SOAP against an independent implementation: pytorch-optimizer (test-only).

- ``SOAP`` vs pytorch-optimizer's ``SOAP`` (a port of the original SOAP code): *same
  arithmetic* for the state. On a matrix within ``max_preconditioner_dim`` (one tile) our tile
  math is the original's op for op, so moments, statistics and eigenbases are bit-identical at
  every step. The parameter update differs in one op (ours ``p - (s U)``, theirs
  ``p.add_(U, alpha=-s)``, which may fuse), so parameters are compared with the derived bound
  ``sum_t u (4 max|p_t| + 2 max|dp_t|)`` (u = 2^-24: each of the ~4 roundings per element per
  step is at most u of its result; gradients do not depend on parameters here, so the
  differences only add up).
- ``Shampoo`` vs ``ScalableShampoo`` (SGD grafting) and ``Shampoo`` (no grafting):
  *different arithmetic* (their roots by SVD, ours by eigh; their statistics start at eps I,
  ours add eps at the root). The bound is derived at every step from the spectrum of the
  statistics, computed in float64 from the gradients: a backward-stable decomposition of ``A``
  is exact for ``A + E``, ``||E|| <= n u ||A|| (+ eps``, the different placement of eps), and
  the Frechet derivative of ``x^(-1/4)`` is at most ``1/4 lambda_min^(-5/4)``; so
  ``||dX|| <= 2 (n u ||A|| + eps) lambda_min^(-5/4) / 4 + 2 n u ||X||`` (both sides err),
  ``||dP|| <= ||dX_L|| ||G|| ||X_R|| + ||X_L|| ||G|| ||dX_R||``, grafting's normalization
  doubles the relative error, and the parameter error is the sum over steps of ``lr ||dU||``
  plus the update's roundings.

pytorch-optimizer's Shampoo preconditions from step 1, where ``G^T G`` of a wide ``G`` is
singular and the root is dominated by ``eps^(-1/4)`` on its null space; the comparisons
therefore use square matrices for it and ``start_preconditioning_step=3`` for
``ScalableShampoo`` (statistics of full rank), so that the bounds are far below the movement.
"""

from __future__ import annotations

from typing import Any

import pytest
import pytorch_optimizer
import torch

import optim_blockwise as ob

pytestmark = pytest.mark.numerics

U = 2.0**-24


@pytest.fixture(autouse=True)
def _one_thread() -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape", [(24, 40), (40, 24), (16, 16)])
def test_soap_state_bit_identical_to_pytorch_optimizer(shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(shape, generator=gen)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    kw: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.05, "precondition_frequency": 3}
    ours = ob.SOAP([a], betas=(0.9, 0.95), **kw)
    ref = pytorch_optimizer.SOAP([b], betas=(0.9, 0.95), **kw)
    tol = 0.0
    for step in range(12):
        g = torch.randn(shape, generator=gen) * 10.0 ** ((step % 3) - 1)
        a.grad, b.grad = g.clone(), g.clone()
        before = b.detach().clone()
        ours.step()
        ref.step()
        mine, theirs = ours.state[a], ref.state[b]
        assert torch.equal(mine["block0_exp_avg"], theirs["exp_avg"]), step
        assert torch.equal(mine["block0_exp_avg_sq"], theirs["exp_avg_sq"]), step
        assert torch.equal(mine["block0_GG_L"], theirs["GG"][0]), step
        assert torch.equal(mine["block0_GG_R"], theirs["GG"][1]), step
        assert torch.equal(mine["block0_Q_L"], theirs["Q"][0]), step
        assert torch.equal(mine["block0_Q_R"], theirs["Q"][1]), step
        moved = float((b.detach() - before).abs().max())
        tol += U * (4 * float(b.detach().abs().max()) + 2 * moved)
        assert float((a.detach() - b.detach()).abs().max()) <= tol, step
    assert float((b.detach() - w0).abs().max()) > 1e4 * tol, "the bound is far below the movement"


def _root_error(a: torch.Tensor, eps: float) -> tuple[torch.Tensor, float]:
    """``(X = A^(-1/4), bound on ||dX||_2)`` for float64 statistics ``A`` (see module doc)."""
    values, vectors = torch.linalg.eigh(a)
    n = a.shape[0]
    lam_min = float(values.min())
    assert lam_min > 0
    x = (vectors * values.pow(-0.25)) @ vectors.T
    norm_a = float(values.max())
    perturbation = n * U * norm_a + eps
    bound = 2 * perturbation * 0.25 * lam_min**-1.25 + 2 * n * U * float(values.min() ** -0.25)
    return x, bound


def _shampoo_bound(
    grads: list[torch.Tensor],
    eps: float,
    beta2: float,
    start: int,
    grafted: bool,
    lr: float,
    params: list[torch.Tensor],
) -> float:
    """Sum over steps of ``lr ||dU||_F`` plus the update's roundings (float64 evaluation)."""
    h, w = grads[0].shape
    left = eps * torch.eye(h, dtype=torch.float64)
    right = eps * torch.eye(w, dtype=torch.float64)
    total = 0.0
    for t, g32 in enumerate(grads, start=1):
        g = g32.double()
        w2 = 1.0 if beta2 == 1.0 else 1.0 - beta2
        left = left * beta2 + w2 * (g @ g.T) if beta2 < 1 else left + g @ g.T
        right = right * beta2 + w2 * (g.T @ g) if beta2 < 1 else right + g.T @ g
        step_move = float(params[t].sub(params[t - 1]).abs().max())
        total += 2 * U * (float(params[t - 1].abs().max()) + step_move)
        if t < start:
            continue
        xl, dl = _root_error(left, eps)
        xr, dr = _root_error(right, eps)
        gn = float(torch.linalg.vector_norm(g))
        dp = (
            dl * gn * float(torch.linalg.matrix_norm(xr, 2))
            + float(torch.linalg.matrix_norm(xl, 2)) * gn * dr
        )
        if grafted:
            p_norm = float(torch.linalg.vector_norm(xl @ g @ xr))
            dp = 2 * dp * gn / p_norm
        total += lr * dp
    return total


@pytest.mark.parametrize("variant", ["ScalableShampoo-sgd-grafting", "Shampoo-no-grafting"])
def test_shampoo_trajectory_matches_pytorch_optimizer(variant: str) -> None:
    from pytorch_optimizer.optimizer.utils.graft import LayerWiseGrafting

    gen = torch.Generator().manual_seed(0)
    lr = 1e-2
    if variant.startswith("Scalable"):
        shape, eps, beta2, start = (24, 40), 1e-12, 0.99, 3
    else:
        shape, eps, beta2, start = (16, 16), 1e-4, 1.0, 1
    w0 = torch.randn(shape, generator=gen)
    a, b = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    grafting = "sgd" if variant.startswith("Scalable") else "none"
    ours = ob.Shampoo(
        [a],
        lr=lr,
        betas=(0.0, beta2),
        epsilon=eps,
        precondition_frequency=1,
        start_preconditioning_step=start,
        grafting=grafting,
    )
    ref: torch.optim.Optimizer
    if variant.startswith("Scalable"):
        ref = pytorch_optimizer.ScalableShampoo(
            [b],
            lr=lr,
            betas=(0.0, beta2),
            start_preconditioning_step=start,
            preconditioning_compute_steps=1,
            block_size=64,
            graft_type=LayerWiseGrafting.SGD,
            use_svd=True,
            matrix_eps=eps,
        )
    else:
        ref = pytorch_optimizer.Shampoo([b], lr=lr, matrix_eps=eps)
    grads, history = [], [w0.clone()]
    for _ in range(8):
        g = torch.randn(shape, generator=gen)
        grads.append(g)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
        history.append(b.detach().clone())
    bound = _shampoo_bound(grads, eps, beta2, start, grafting != "none", lr, history)
    diff = float((a.detach() - b.detach()).abs().max())
    moved = float((b.detach() - w0).abs().max())
    assert diff <= bound, (
        f"{variant}: max |ours - reference| {diff:.3g} > derived bound {bound:.3g}"
    )
    assert bound < 0.05 * moved, f"{variant}: bound {bound:.3g} vs movement {moved:.3g}"
