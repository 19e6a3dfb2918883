"""The linear algebra of Shampoo and SOAP: inverse matrix roots and eigenbases, with guards.

[Note: numerical guards]
Statistics ``A = sum G G^T`` are symmetric positive semi-definite and often nearly singular (a
tile seeing a low-rank gradient). Following the references:

- Shampoo's ``(A + eps I)^(-1/p)`` adds ``epsilon`` to the diagonal, takes a symmetric
  eigendecomposition and clamps the eigenvalues at ``epsilon`` from below (rounding can make the
  smallest ones slightly negative, and a negative number has no real root);
- SOAP's eigenbasis is ``eigh(A + 1e-30 I)`` (the original SOAP code), columns by decreasing
  eigenvalue, refreshed by one power iteration and a QR decomposition (also the original's);
- a decomposition that raises or returns non-finite values is retried in float64; if that fails
  too, ``None`` is returned and the caller keeps the previous root / eigenbasis (Meta's Shampoo
  does the same), counting the fallback.

Everything is computed in the ``dtype`` the caller passes (float32 by default, float64 on
request) and returned in it.
"""

from __future__ import annotations

import torch

__all__ = ["inverse_root", "eigenbasis", "refresh_eigenbasis", "project", "project_back"]


def _eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    try:
        values, vectors = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
        return None
    if not (bool(torch.isfinite(values).all()) and bool(torch.isfinite(vectors).all())):
        return None
    return values, vectors


def _inverse_root_in(a: torch.Tensor, root: float, epsilon: float) -> torch.Tensor | None:
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    found = _eigh(a + epsilon * eye)
    if found is None:
        return None
    values, vectors = found
    scale = values.clamp(min=epsilon).pow(-1.0 / root)
    out = (vectors * scale) @ vectors.T
    return out if bool(torch.isfinite(out).all()) else None


def inverse_root(
    matrix: torch.Tensor, root: float, epsilon: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """``(A + epsilon I)^(-1/root)`` of a symmetric PSD ``A``, in ``dtype``; None on failure.

    ``Q diag(max(lambda, epsilon)^(-1/root)) Q^T`` from ``eigh(A + epsilon I)``. A failure in
    float32 is retried in float64 and rounded back.
    """
    out = _inverse_root_in(matrix.to(dtype), root, epsilon)
    if out is None and dtype != torch.float64:
        wide = _inverse_root_in(matrix.to(torch.float64), root, epsilon)
        out = None if wide is None else wide.to(dtype)
    return out


def _basis_in(a: torch.Tensor) -> torch.Tensor | None:
    eye = torch.eye(a.shape[0], device=a.device, dtype=a.dtype)
    found = _eigh(a + 1e-30 * eye)
    return None if found is None else torch.flip(found[1], dims=[1])


def eigenbasis(matrix: torch.Tensor) -> torch.Tensor | None:
    """Eigenvectors of a symmetric ``A`` as columns by decreasing eigenvalue (SOAP's first basis).

    ``eigh(A + 1e-30 I)`` in ``A``'s dtype, flipped; retried in float64; None on failure.
    """
    out = _basis_in(matrix)
    if out is None and matrix.dtype != torch.float64:
        wide = _basis_in(matrix.to(torch.float64))
        out = None if wide is None else wide.to(matrix.dtype)
    return out


def refresh_eigenbasis(
    matrix: torch.Tensor, basis: torch.Tensor, second_moment: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One power iteration of SOAP's eigenbasis: ``(new basis, second moment re-ordered)``.

    The current basis's columns are sorted by their Rayleigh quotients ``q_i^T A q_i``
    (decreasing), ``second_moment`` (kept in the rotated coordinates) is permuted the same way
    along ``dim``, and the new basis is the Q factor of ``A Q`` (QR in float32 at least). None if
    the QR is not finite (the caller keeps the old basis).
    """
    product = matrix @ basis
    estimate = (basis * product).sum(dim=0)
    order = torch.argsort(estimate, descending=True)
    permuted = second_moment.index_select(dim, order)
    power = product.index_select(1, order)
    qr_dtype = torch.float64 if power.dtype == torch.float64 else torch.float32
    q, _ = torch.linalg.qr(power.to(qr_dtype))
    if not bool(torch.isfinite(q).all()):
        return None
    return q.to(power.dtype), permuted


def project(g: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``Q_L^T G Q_R`` as two ``tensordot``s (the original SOAP's op order)."""
    g = torch.tensordot(g, left, dims=[[0], [0]])
    out: torch.Tensor = torch.tensordot(g, right, dims=[[0], [0]])
    return out


def project_back(g: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """``Q_L G Q_R^T``, the inverse rotation of ``project``."""
    g = torch.tensordot(g, left, dims=[[0], [1]])
    out: torch.Tensor = torch.tensordot(g, right, dims=[[0], [1]])
    return out
