"""Checking that every rank of a mesh built the same buffer, before any sized collective runs.

[Note: why agree before communicating]
If ranks pass self-consistent but mutually different sizes to a collective, gloo aborts the process
(SIGABRT) and NCCL hangs. So a DBuffer compares a small record (layout fingerprint, shard size,
dtype, shapes digest) across the whole mesh at construction, with the agreement check every
package shares (``ragged_dtensor.check_ranks_agree``: one fixed-size digest all-gather per mesh
axis, the records themselves only when they differ). Every rank reaches the same verdict and
raises the same error: nobody is left waiting.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh

from ragged_dtensor import RanksDisagreeError, check_ranks_agree

__all__ = ["LayoutMismatchError", "check_agreement"]


class LayoutMismatchError(RanksDisagreeError):
    """Ranks of one mesh built different buffers (layouts, dtypes or shapes differ)."""


def check_agreement(mesh: DeviceMesh, record: dict[str, str], *, what: str = "DBuffer") -> None:
    """Raise ``LayoutMismatchError`` on every rank unless all ranks of ``mesh`` hold ``record``."""
    check_ranks_agree(
        mesh,
        record,
        what=(
            f"{what}: the ranks of the mesh built different buffers (compared at construction, "
            f"before any collective)"
        ),
        error=LayoutMismatchError,
    )
