"""Views of one flat storage that serialize and copy as their own elements only.

[Note: views over storage of their own]
A flat-buffer FSDP keeps a group's shard in one storage and hands out each parameter's local
tensor (and each gradient's) as a view of it. torch serializes and copies a view through its
storage: ``torch.save`` / ``pickle`` / ``copy.deepcopy`` of one such view (or of a DTensor over it,
or of anything derived from it: ``to_local()``, ``detach()``, a ``state_dict()`` entry) write or
copy the whole storage, the rank's whole group shard. And a DTensor wrapper takes its local
tensor's storage offset over a null storage, so a DTensor over a view that starts at an offset
reports a non-zero ``data_ptr()``, which torch's copying code reads as "a tensor with storage"
(``torch.save`` / ``deepcopy`` / DCP's stager then fail: "invalid python storage").

``own_storage_view`` gives the same elements (no copy) as a tensor at offset 0 of a storage that
spans exactly them: torch's storage slice (``UntypedStorage[a:b]``), a storage whose data pointer
is an interior pointer of the parent's allocation and whose deleter holds a reference to the
parent's storage, so the parent's memory lives while any slice does. Everything torch does with a
tensor then sees only these elements: saves write them, copies copy them, a DTensor over it has
its wrapper at offset 0 (``data_ptr() == 0``, as every FSDP2 parameter's), and no torch object
needs changing. Writes through either alias are the same memory (in-place optimizer steps,
collectives into the flat buffer).

What this gives up, and how it is met:
- torch no longer knows that the slices and the flat buffer alias: two storages. Code that needs
  "where in the flat buffer" asks ``storage_base`` (the storage a slice was cut from and the byte
  offset), e.g. to make one view over neighbouring parameters (optim-blockwise's runs, a
  checkpoint stager's spans). Autograd's version counters are per storage family: an in-place
  write through the flat buffer does not bump a slice's counter. Nothing saves sharded locals for
  backward (the unsharded parameters are what the forward uses).
- the parent must not be resized while slices live (their pointers would dangle): the sharded
  storages these slices come from are replaced, never resized (``resize_(0)`` frees only the
  unsharded and the accumulation buffers).
- meta tensors (no data) are returned as they are; a view without elements (a parameter wholly
  on other ranks) becomes an empty tensor of its own (it aliases nothing).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["own_storage_view", "storage_base"]


def _weak(storage: torch.UntypedStorage) -> StorageWeakRef:
    return StorageWeakRef(storage)  # type: ignore[no-untyped-call]


def _expired(ref: StorageWeakRef) -> bool:
    return bool(ref.expired())  # type: ignore[no-untyped-call]


# a slice storage we made: weak references to it and to its parent, the byte offset (a tuple:
# one is made per gradient per step)
_Cut = tuple[StorageWeakRef, StorageWeakRef, int]


_LOCK = threading.Lock()
_SLICE: Any = getattr(torch._C.StorageBase, "__getitem__")  # noqa: B009 - untyped C slot
# keyed by the slice's StorageImpl address; a live entry's weak reference keeps the address from
# being reused (intrusive_ptr frees the object only when the weak count is zero too)
_CUTS: dict[int, _Cut] = {}
_PRUNE_AT = [256]


def _prune() -> None:
    with _LOCK:
        for key in [k for k, cut in _CUTS.items() if _expired(cut[0])]:
            del _CUTS[key]
        _PRUNE_AT[0] = max(256, 2 * len(_CUTS))


def _byte_extent(tensor: torch.Tensor) -> int:
    """Bytes from the tensor's first element to past its last (it has elements)."""
    if tensor.is_contiguous():
        return tensor.numel() * tensor.element_size()
    last = sum((int(n) - 1) * int(s) for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return (last + 1) * tensor.element_size()


def storage_base(tensor: torch.Tensor) -> tuple[torch.UntypedStorage, int]:
    """The storage ``tensor``'s memory was cut from, and the byte offset in it where
    ``tensor``'s own storage starts: ``(parent, offset)`` for a tensor over a storage made by
    ``own_storage_view``, ``(tensor.untyped_storage(), 0)`` for any other tensor. A tensor's
    first element is at byte ``offset + tensor.storage_offset() * tensor.element_size()`` of
    the returned storage."""
    storage = tensor.untyped_storage()
    cut = _CUTS.get(storage._cdata)
    if cut is None or _expired(cut[0]):
        return storage, 0
    # the slice holds its parent (its deleter's context), so the parent is alive
    parent = torch.UntypedStorage._new_with_weak_ptr(cut[1].cdata)
    return parent, cut[2]


def own_storage_view(view: torch.Tensor) -> torch.Tensor:
    """``view``'s elements (no copy) as a tensor at offset 0 of a storage spanning exactly them
    ([Note: views over storage of their own]); ``view`` itself when it already is one, is on
    meta or is not a plain tensor (a subclass keeps its own storage); an empty tensor of its own
    when it has no elements. Not differentiable: for local shards, outside autograd."""
    if type(view) is not torch.Tensor or view.is_meta or view.requires_grad:
        return view
    if view.numel() == 0:  # nothing to alias: an empty tensor of its own (no memory)
        if view.storage_offset() == 0 and view.untyped_storage().nbytes() == 0:
            return view
        return torch.empty_strided(view.shape, view.stride(), dtype=view.dtype, device=view.device)
    storage = view.untyped_storage()
    start = int(view.storage_offset()) * view.element_size()
    stop = start + _byte_extent(view)
    if start == 0 and stop == storage.nbytes():
        return view
    parent, base = storage_base(view)
    # torch's C slice (UntypedStorage.__getitem__ adds only a meta check, done above)
    piece = _SLICE(parent, slice(base + start, base + stop))
    out = view.new().set_(piece, 0, view.shape, view.stride())
    with _LOCK:
        _CUTS[piece._cdata] = (_weak(piece), _weak(parent), base + start)
    if len(_CUTS) > _PRUNE_AT[0]:
        _prune()
    return out
