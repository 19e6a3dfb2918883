"""Storages whose memory comes and goes while the storage object (and every view) stays.

[Note: storage lifetime]
A DBuffer allocates, once and for the whole group, a shard storage of S elements (persistent)
and an unsharded tensor of m * S elements whose storage is empty except between ``unshard`` and
``reshard``. Freeing is ``untyped_storage().resize_(0)`` and re-allocation ``resize_(nbytes)``: the
storage *object* never changes, so every view made once (full tensors, autograd's saved tensors,
``.grad`` views) keeps pointing at it across release and re-allocation, and the memory is returned
when ``reshard`` returns -- deterministically, not when a caching allocator decides. Views are
made once and reused every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh

from dbuffer._private import streams
from dbuffer._private.layout import TensorSlot

__all__ = ["Unsharded", "allocate_storage", "free_storage", "mesh_device"]


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """This rank's device on ``mesh``: its device type, the current index for accelerators."""
    kind = mesh.device_type
    if kind == "cpu":
        return torch.device(kind)
    return torch.device(kind, torch.get_device_module(kind).current_device())


def free_storage(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes() != 0:
        storage.resize_(0)


def allocate_storage(tensor: torch.Tensor) -> bool:
    """Give ``tensor``'s storage its full size again; True if it had been freed."""
    storage = tensor.untyped_storage()
    nbytes = tensor.numel() * tensor.element_size()
    if storage.nbytes() == nbytes:
        return False
    storage.resize_(nbytes)
    return True


class Unsharded:
    """An unsharded flat tensor of one dtype with its full views (made once), and the stream
    whose allocator pool holds its memory while allocated."""

    def __init__(
        self,
        size: int,
        slots: Sequence[TensorSlot],
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.device = device
        self.flat = torch.empty(size, dtype=dtype, device=device)
        self.views = tuple(self.flat[s.offset : s.offset + s.numel].view(s.shape) for s in slots)
        self.owner: torch.Stream | None = None
        free_storage(self.flat)

    @property
    def allocated(self) -> bool:
        return self.flat.untyped_storage().nbytes() != 0

    def allocate(self) -> None:
        """Memory for the flat tensor from the current stream's pool."""
        grown = allocate_storage(self.flat)
        if grown and streams.comm_stream_for(self.device) is not None:
            self.owner = streams.current_stream(self.device)

    def release(self) -> None:
        """Free the memory; its pool's stream first waits for every use the caller's stream
        issued ([Note: streams and frees without record_stream] in streams.py)."""
        if self.allocated:
            streams.hand_back(self.owner, self.device)
        free_storage(self.flat)
        self.owner = None
