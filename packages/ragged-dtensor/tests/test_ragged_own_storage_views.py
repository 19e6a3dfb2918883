"""``own_storage_view`` gives a view's elements, no copy, over a storage of their own: saved,
pickled and deep-copied as those elements (a plain view: its whole storage, torch's rule, the
control), written through by the buffer and back; ``storage_base`` finds the buffer again.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle

import torch

from ragged_dtensor import own_storage_view, storage_base


def _saved(value: torch.Tensor) -> int:
    return len(_save_bytes(value))


def test_a_view_over_storage_of_its_own_aliases_and_serializes_its_elements_only() -> None:
    flat = torch.arange(100_000, dtype=torch.float32)
    view = flat[40_000:40_100].view(10, 10)
    own = own_storage_view(view)
    assert own.storage_offset() == 0 and own.untyped_storage().nbytes() == 400
    assert own.data_ptr() == view.data_ptr() and torch.equal(own, view)
    flat[40_000] = -1.0  # the same memory, both ways
    own[9, 9] = -2.0
    assert own[0, 0] == -1.0 and flat[40_099] == -2.0
    assert _saved(own) < 2_000 and _saved(view) > 400_000  # torch's rule for the plain view
    assert len(pickle.dumps(own)) < 2_000 and len(pickle.dumps(view)) > 400_000
    assert copy.deepcopy(own).untyped_storage().nbytes() == 400
    loaded = torch.load(io.BytesIO(_save_bytes(own)))  # weights_only=True
    assert torch.equal(loaded, own) and loaded.untyped_storage().nbytes() == 400
    base, offset = storage_base(own)
    assert base.data_ptr() == flat.untyped_storage().data_ptr() and offset == 40_000 * 4
    assert storage_base(flat)[1] == 0
    again = own_storage_view(own[1:3].reshape(-1))  # a slice of a slice: placed in the buffer
    assert storage_base(again)[1] == (40_000 + 10) * 4
    assert storage_base(again)[0].data_ptr() == flat.untyped_storage().data_ptr()
    del flat, base, view
    gc.collect()
    assert own[0, 0] == -1.0  # the slice keeps the buffer's memory alive


def _save_bytes(value: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_what_own_storage_view_leaves_as_it_is() -> None:
    flat = torch.zeros(10)
    assert own_storage_view(flat) is flat  # already its own storage
    meta = torch.empty(10, device="meta")[2:5]
    assert own_storage_view(meta) is meta
    empty = own_storage_view(flat[4:4])
    assert empty.numel() == 0 and empty.untyped_storage().nbytes() == 0
    differentiable = torch.zeros(10, requires_grad=True)[1:3]
    assert own_storage_view(differentiable) is differentiable  # autograd's: left as it is
