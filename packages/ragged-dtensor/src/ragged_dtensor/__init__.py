"""RaggedShard: a DTensor placement of contiguous blocks of any size, uneven per rank."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from ragged_dtensor._private.geometry import FlatRange, flat_range_to_boxes
from ragged_dtensor._private.placement import RaggedShard

try:
    __version__ = version("ragged-dtensor")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0+unknown"

__all__ = [
    "RaggedShard",
    "FlatRange",
    "flat_range_to_boxes",
    "__version__",
]
