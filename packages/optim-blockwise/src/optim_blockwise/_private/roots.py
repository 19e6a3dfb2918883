"""The linear algebra of Shampoo and SOAP: inverse matrix roots and eigenbases, with guards.

[Note: numerical guards]
Statistics ``A = sum G G^T`` are symmetric positive semi-definite and often nearly singular (a
tile seeing a low-rank gradient). Following the references:

- Shampoo's ``(A + eps I)^(-1/p)`` adds ``epsilon`` to the diagonal, takes a symmetric
  eigendecomposition and clamps the eigenvalues at ``epsilon`` from below (rounding can make the
  smallest ones slightly negative, and a negative number has no real root);
- SOAP's eigenbasis is ``eigh(A + 1e-30 I)`` (the original SOAP code), columns by decreasing
  eigenvalue, refreshed by one power iteration and a QR decomposition (also the original's);
- a result that is not finite (non-finite statistics, from a NaN/Inf gradient) is replaced
  by the previous root / eigenbasis (the identity before the first one), as Meta's Shampoo
  does, and the caller counts the fallback. In the optimizers' step this is decided on the
  device (``torch.where`` on a finiteness flag), never read on the host: no synchronization
  per tile and refresh. A decomposition that *raises* (no convergence) is retried in float64
  (the exception has reached the host anyway); a non-finite float32 result is not retried in
  float64 inside the step, since choosing to would need that host read, and non-finite
  statistics fail in float64 as well. The public ``inverse_root`` (no step, no previous root)
  keeps the host decision: a non-finite result is retried in float64, then ``None``.

[Note: eigh's host sync]
``torch.linalg.eigh`` checks its solver status on the host: on CUDA each call waits for the
device. It is the one host sync the optimizers keep, and only where the maths needs it: in a
refresh step (Shampoo's roots, every ``precondition_frequency`` steps; SOAP's first basis, step
one), once per tile and side, never in the steps between (SOAP's later refreshes use QR, which
reads nothing on the host). ``test_optim_host_reads`` counts the eighs of every step.

Everything is computed in the ``dtype`` the caller passes (float32 by default, float64 on
request) and returned in it.
"""

from __future__ import annotations

import torch

__all__ = [
    "inverse_root",
    "refreshed_inverse_root",
    "first_eigenbasis",
    "refresh_eigenbasis",
    "project",
    "project_back",
]


def _eigh(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(values, vectors, finite)``: ``finite`` a device flag; None if eigh raised."""
    try:
        values, vectors = torch.linalg.eigh(matrix)
    except RuntimeError:  # torch.linalg.LinAlgError derives from RuntimeError
        return None
    return values, vectors, torch.isfinite(values).all() & torch.isfinite(vectors).all()


def _inverse_root_in(
    a: torch.Tensor, root: float, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``((a + epsilon I)^(-1/root), finite)`` in ``a``'s dtype; None if eigh raised."""
    eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    found = _eigh(a + epsilon * eye)
    if found is None:
        return None
    values, vectors, finite = found
    scale = values.clamp(min=epsilon).pow(-1.0 / root)
    out = (vectors * scale) @ vectors.T
    return out, finite & torch.isfinite(out).all()


def _inverse_root_or_raised(
    matrix: torch.Tensor, root: float, epsilon: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``_inverse_root_in`` in ``dtype``, retried in float64 if eigh raised."""
    found = _inverse_root_in(matrix.to(dtype), root, epsilon)
    if found is None and dtype != torch.float64:
        wide = _inverse_root_in(matrix.to(torch.float64), root, epsilon)
        found = None if wide is None else (wide[0].to(dtype), wide[1])
    return found


def inverse_root(
    matrix: torch.Tensor, root: float, epsilon: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor | None:
    """``(A + epsilon I)^(-1/root)`` of a symmetric PSD ``A``, in ``dtype``; None on failure.

    ``Q diag(max(lambda, epsilon)^(-1/root)) Q^T`` from ``eigh(A + epsilon I)``. A failure in
    float32 (eigh raising, or a non-finite result: decided on the host) is retried in float64
    and rounded back. The optimizers' step uses ``refreshed_inverse_root`` instead.
    """
    found = _inverse_root_in(matrix.to(dtype), root, epsilon)
    if (found is None or not bool(found[1])) and dtype != torch.float64:
        wide = _inverse_root_in(matrix.to(torch.float64), root, epsilon)
        found = None if wide is None else (wide[0].to(dtype), wide[1])
    return found[0] if found is not None and bool(found[1]) else None


def refreshed_inverse_root(
    matrix: torch.Tensor,
    root: float,
    epsilon: float,
    dtype: torch.dtype,
    previous: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's new root, decided on the device: ``(A + epsilon I)^(-1/root)`` in ``dtype``
    where it is finite, else ``previous``; and the fallback as a device flag (0-dim bool).

    No host read: the choice is a ``torch.where`` (written into the new root's storage, so
    memory and strides are the new root's). An eigh that raises is retried in float64."""
    found = _inverse_root_or_raised(matrix, root, epsilon, dtype)
    if found is None:  # raised in float64 too: known on the host already
        return previous, torch.ones((), dtype=torch.bool, device=previous.device)
    out, finite = found
    return torch.where(finite, out, previous, out=out), ~finite


def _basis_in(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    eye = torch.eye(a.shape[0], device=a.device, dtype=a.dtype)
    found = _eigh(a + 1e-30 * eye)
    return None if found is None else (torch.flip(found[1], dims=[1]), found[2])


def first_eigenbasis(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """SOAP's first basis: the eigenvectors of a symmetric ``A`` as columns by decreasing
    eigenvalue (``eigh(A + 1e-30 I)`` in ``A``'s dtype, flipped; eigh raising is retried in
    float64), or the identity where they are not finite (column-major like LAPACK's bases);
    and the fallback as a device flag. Decided on the device: no host read."""
    found = _basis_in(matrix)
    if found is None and matrix.dtype != torch.float64:
        wide = _basis_in(matrix.to(torch.float64))
        found = None if wide is None else (wide[0].to(matrix.dtype), wide[1])
    n = matrix.shape[0]
    eye = torch.eye(n, dtype=matrix.dtype, device=matrix.device).t()  # column-major
    if found is None:
        return eye, torch.ones((), dtype=torch.bool, device=matrix.device)
    basis, finite = found
    return torch.where(finite, basis, eye, out=basis), ~finite


def refresh_eigenbasis(
    matrix: torch.Tensor, basis: torch.Tensor, second_moment: torch.Tensor, dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One power iteration of SOAP's eigenbasis: ``(new basis, second moment re-ordered,
    fallback flag)``.

    The current basis's columns are sorted by their Rayleigh quotients ``q_i^T A q_i``
    (decreasing), ``second_moment`` (kept in the rotated coordinates) is permuted the same way
    along ``dim``, and the new basis is the Q factor of ``A Q`` (QR in float32 at least). Where
    the QR is not finite, the old basis and second moment are kept: decided on the device
    (``torch.where``), the fallback returned as a device flag.
    """
    product = matrix @ basis
    estimate = (basis * product).sum(dim=0)
    order = torch.argsort(estimate, descending=True)
    permuted = second_moment.index_select(dim, order)
    power = product.index_select(1, order)
    qr_dtype = torch.float64 if power.dtype == torch.float64 else torch.float32
    q, _ = torch.linalg.qr(power.to(qr_dtype))
    finite = torch.isfinite(q).all()
    q = q.to(power.dtype)
    return (
        torch.where(finite, q, basis, out=q),
        torch.where(finite, permuted, second_moment, out=permuted),
        ~finite,
    )


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
