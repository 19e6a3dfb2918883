"""What torch's copying code needs of the engine's DTensors: ``data_ptr() == 0``.

[Note: a DTensor's data_ptr]
The engine's sharded parameters are DTensors whose local tensors are views of one flat shard
storage per group, at offsets (FlatAdamW's state too). torch 2.13 builds a DTensor's wrapper
with its local tensor's ``storage_offset`` over a null storage, so ``data_ptr()`` of such a
DTensor is ``0 + offset * itemsize``: 128 for the second parameter of a group, never an
address. torch's Python code reads ``data_ptr() == 0`` as "a wrapper subclass without storage of
its own" and ``!= 0`` as "copy its storage": ``Tensor.__deepcopy__``
(``copy.deepcopy(model.state_dict())``), ``Tensor.__reduce_ex__`` (``torch.save``, pickling) and
DCP's state-dict stager (``dcp.async_save``, ``DefaultStager``, ``BlockingAsyncStager``,
``_copy_state_dict`` through ``_create_cpu_state_dict``) then take the storage path and fail
("Attempted to call copy_() on an invalid python storage"; before ragged-dtensor's fix, first on
the stager's ``new_empty([])``). FSDP2's parameters own their storage from offset 0, so their
DTensors report 0 and take the wrapper path (a copy through the local tensor). So
``DTensor.data_ptr`` returns 0, which every DTensor FSDP2 makes already returns: a DTensor's data
is its local tensor's, whose ``data_ptr()`` is unchanged.

Importing fsdp_engine changes nothing in torch (the team's rule, issue 27): ``fully_shard``
installs it, the first time it runs (the engine's first DTensors), as ragged-dtensor's
integration is installed by the first RaggedShard; ``install_dtensor_data_ptr`` does it
explicitly, ``uninstall_dtensor_data_ptr`` puts torch's method back. A ``data_ptr`` that another
library put on DTensor is left alone (and reported). Building the engine's DTensors with a zero
wrapper offset would not do: every op's output (``detach`` in ``state_dict()``) is a new wrapper
with its local tensor's offset.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from torch.distributed.tensor import DTensor

__all__ = [
    "dtensor_data_ptr_installed",
    "install_dtensor_data_ptr",
    "installs_dtensor_data_ptr",
    "uninstall_dtensor_data_ptr",
]

F = TypeVar("F", bound=Callable[..., Any])


def _dtensor_data_ptr(self: DTensor) -> int:
    """0: a DTensor owns no storage; its data is its local tensor's (see [Note: a DTensor's
    data_ptr] in fsdp_engine's ``checkpoint_dtensor``)."""
    return 0


def dtensor_data_ptr_installed() -> bool:
    return DTensor.__dict__.get("data_ptr") is _dtensor_data_ptr


def install_dtensor_data_ptr() -> bool:
    """Make ``DTensor.data_ptr`` return 0 (idempotent). ``False``, with a warning, when DTensor
    already has a ``data_ptr`` of its own that is not ours (left as it is)."""
    current = DTensor.__dict__.get("data_ptr")
    if current is _dtensor_data_ptr:
        return True
    if current is not None:
        warnings.warn(
            f"fsdp_engine: DTensor.data_ptr is already {current!r}; left as it is, so DCP's "
            f"stagers, copy.deepcopy and torch.save may fail on the engine's state dicts",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    DTensor.data_ptr = _dtensor_data_ptr  # type: ignore[assignment,method-assign]
    return True


def uninstall_dtensor_data_ptr() -> None:
    """Put torch's ``DTensor.data_ptr`` back (nothing to do unless ours is installed)."""
    if dtensor_data_ptr_installed():
        del DTensor.data_ptr


def installs_dtensor_data_ptr(function: F) -> F:
    """``function`` (``fully_shard``), installing ``DTensor.data_ptr`` before it first runs."""

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not dtensor_data_ptr_installed():
            install_dtensor_data_ptr()
        return function(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
