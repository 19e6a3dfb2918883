"""Argument checks shared by the optimizers: each error names the argument and the range."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["check_nonnegative", "check_betas"]


def check_nonnegative(name: str, value: float) -> None:
    """``value`` must be a finite number >= 0 (NaN compares False with everything)."""
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def check_betas(name: str, betas: Sequence[float]) -> None:
    """Two finite coefficients in [0, 1)."""
    if len(betas) != 2 or not all(
        isinstance(b, int | float) and math.isfinite(b) and 0.0 <= b < 1.0 for b in betas
    ):
        raise ValueError(f"{name} must be two numbers in [0, 1), got {tuple(betas)}")
