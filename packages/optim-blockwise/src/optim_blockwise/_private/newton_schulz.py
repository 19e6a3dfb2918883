"""Newton-Schulz orthogonalization, learning-rate scaling and root balancing for Muon."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from optim_blockwise._private.owners import assign_owners

__all__ = [
    "DEFAULT_NS_COEFFICIENTS",
    "newton_schulz",
    "adjust_lr",
    "ns_flops",
    "ns_root_bytes",
    "assign_roots",
]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(
    matrix: torch.Tensor,
    coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
    steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximate ``U V^T`` of ``matrix = U S V^T`` by the quintic Newton-Schulz iteration.

    ``X <- X / max(||X||_F, eps)`` (so every singular value is <= 1), then ``steps`` times
    ``A = X X^T; B = b A + c A^2; X = a X + B X``. The coefficients maximize the slope at 0, so
    singular values land in roughly [0.7, 1.2] instead of converging to exactly 1 (Keller
    Jordan's Muon). A tall matrix is transposed first so that ``A`` is the smaller Gram matrix.
    Computed in ``dtype`` (bf16 like the reference; fp32 for tight tests); the result is in
    ``dtype``. The op order matches ``torch.optim.Muon`` so results agree with it bit for bit
    on the same input.

    A 3-D input is a batch of matrices (MoE experts, or same-shape matrices stacked by an
    optimizer): each is orthogonalized on its own (its own norm), with batched matmuls.
    """
    if matrix.dim() not in (2, 3):
        raise ValueError(
            f"Newton-Schulz needs a 2-D matrix or a 3-D batch of matrices, got shape "
            f"{tuple(matrix.shape)}"
        )
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(-2) > matrix.size(-1)
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x.div(x.norm().clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, poly, x, beta=a)
    else:
        x = x.div(x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps))
        for _ in range(steps):
            gram = x @ x.mT
            poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def adjust_lr(lr: float, convention: str, shape: Sequence[int]) -> float:
    """Muon's shape-aware learning rate for a ``rows x cols`` matrix.

    - ``"original"`` (Keller Jordan, torch's default): ``lr * sqrt(max(1, rows / cols))``;
    - ``"match_rms_adamw"`` (Moonlight): ``lr * 0.2 * sqrt(max(rows, cols))``, which gives the
      update the RMS of a typical AdamW update so AdamW's lr and weight decay carry over.
    """
    rows, cols = shape[0], shape[1]
    if convention == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    if convention == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    raise ValueError(f"adjust_lr_fn must be 'original' or 'match_rms_adamw', got {convention!r}")


def ns_flops(shape: Sequence[int], steps: int = 5) -> int:
    """Flops of Newton-Schulz on an ``m x n`` matrix (m <= n): ``steps * (4 m^2 n + 2 m^3)``."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return steps * (4 * m * m * n + 2 * m**3)


def ns_root_bytes(shape: Sequence[int], element_size: int = 2) -> int:
    """Bytes a root holds for Newton-Schulz on an ``m x n`` matrix (s = min(m, n)): the
    gathered matrix, the iterate and its successor, the result (``m n`` each, counted 3x: the
    input is dropped after the first cast) and the two ``s x s`` Gram matrices."""
    m, n = int(shape[0]), int(shape[1])
    s = min(m, n)
    return element_size * (3 * m * n + 2 * s * s)


def assign_roots(costs: Sequence[int], shares: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """Pick a root rank for every matrix, balancing the summed cost over ranks.

    Greedy longest-processing-time: matrices by decreasing cost (ties: lower index first), each
    onto the rank with the least load so far; among equally loaded ranks the one already holding
    the most of the matrix (``shares[i][k]`` elements), which saves traffic, then the lowest rank.
    Deterministic: every rank computes the same answer from the same global shapes. (One cost
    dimension of ``owners.assign_owners``; ``Muon`` balances flops and root memory together.)
    """
    return assign_owners([(c,) for c in costs], shares)
