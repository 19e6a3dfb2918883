"""Fused group ops: one kernel over a whole buffer's shard (or unsharded storage)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, Self

import torch

if TYPE_CHECKING:
    from dbuffer._private.geometry import BufferGeometry

__all__ = ["FusedOps", "Part"]

Part = Literal["shard", "unsharded"]


class FusedOps:
    """Mixed into ``DBuffer``: elementwise ops over every tensor of the group at once."""

    shard: torch.Tensor
    geometry: BufferGeometry
    shard_size: int

    if TYPE_CHECKING:

        def wait(self) -> None: ...
        def is_unsharded(self, dtype: torch.dtype | None = None) -> bool: ...
        def _require_shard(self, op: str) -> None: ...
        def new_like(self, dtype: torch.dtype | None = None) -> Self: ...
        @property
        def unsharded(self) -> torch.Tensor: ...

    def _flat(self, part: Part) -> torch.Tensor:
        self.wait()  # a collective in flight may be writing the storage
        if part == "shard":
            self._require_shard("shard op")
            return self.shard
        if part == "unsharded":
            if not self.is_unsharded():
                raise RuntimeError("DBuffer: the unsharded storage is not allocated")
            return self.unsharded
        raise ValueError(f"part must be 'shard' or 'unsharded', got {part!r}")

    def _require_same(self, other: FusedOps, op: str) -> None:
        if not self.geometry.same(other.geometry):
            raise ValueError(
                f"DBuffer.{op}: the other buffer has a different layout, shapes or "
                f"mesh (shard size {other.shard_size} vs {self.shard_size})"
            )

    def zero_(self, part: Part = "shard") -> Self:
        self._flat(part).zero_()
        return self

    def scale_(self, factor: float, part: Part = "shard") -> Self:
        self._flat(part).mul_(factor)
        return self

    def add_(self, other: FusedOps, *, alpha: float = 1.0, part: Part = "shard") -> Self:
        self._require_same(other, "add_")
        self._flat(part).add_(other._flat(part), alpha=alpha)
        return self

    def copy_(self, other: FusedOps, part: Part = "shard") -> Self:
        """Copy (and cast, if dtypes differ) ``other`` into this buffer."""
        self._require_same(other, "copy_")
        self._flat(part).copy_(other._flat(part))
        return self

    def to(self, dtype: torch.dtype) -> Self:
        """A new buffer holding this one's shard cast to ``dtype`` (one kernel)."""
        out = self.new_like(dtype)
        out.shard.copy_(self.shard)
        return out
