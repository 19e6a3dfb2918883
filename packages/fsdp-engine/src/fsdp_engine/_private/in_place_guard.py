"""Gradients in the parameters' storage, never silently wrong: aliases of an overwritten weight
raise, ``.data`` reads fall back.

[Note: reading an overwritten weight]
With ``set_gradients_in_parameter_storage(True)`` a parameter's gradient overwrites its
unsharded storage once autograd has accumulated it ([Note: gradients in the parameters'
storage] in ``handover.py``). Every node that sends that parameter a gradient has run by then,
but a node that read the weight through an alias autograd does not connect to it (``w.detach()``,
a view taken under ``no_grad``, ``w.data``) may run later in the same backward and read the
gradient instead of the weight. Two guards:

- each unsharded parameter has a version counter of its own (not the one shared by the views
  of the all-gathered buffer), and the overwrite bumps it. ``w.detach()`` and every view of
  ``w`` share that counter, so a node that saved one for backward and unpacks it after the
  overwrite fails autograd's own check ("one of the variables needed for gradient computation
  has been modified by an inplace operation"). The parameter's own uses unpacked their saved
  tensors before its gradient was accumulated: they never see the bump. (With a counter shared
  by the group, the first overwrite would have failed every other layer of the group.)
- ``w.data`` makes a tensor with a new version counter, invisible to that check. The unsharded
  parameters of a group with the option on are ``GuardedParameter``s, which note a ``.data``
  read; a backward after a forward that read one runs the default hand-over for that group
  (the gradients stay beside the parameters), and warns once naming the parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["GuardedParameter", "bump_version", "consume_data_reads", "unsharded_parameter"]

_DATA: Any = vars(torch._C.TensorBase)["data"]  # the C descriptor ``.data`` reads and writes


class GuardedParameter(nn.Parameter):
    """An unsharded parameter of a group whose gradients may overwrite it: notes ``.data``
    reads ([Note: reading an overwritten weight])."""

    @property
    def data(self) -> torch.Tensor:
        self.__dict__["_fsdp_data_read"] = True
        value: torch.Tensor = _DATA.__get__(self)
        return value

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        _DATA.__set__(self, value)


def unsharded_parameter(value: torch.Tensor, requires_grad: bool, guarded: bool) -> nn.Parameter:
    """The unsharded parameter over ``value`` (a view of the all-gathered buffer): a version
    counter of its own for a plain tensor (a DTensor from ``from_local`` has one already; a
    tensor subclass is wrapped as it is), a ``GuardedParameter`` when ``guarded``."""
    cls: Any = GuardedParameter if guarded else nn.Parameter
    if type(value) is not torch.Tensor:
        # A DTensor from ``from_local`` has a counter of its own already; a tensor subclass
        # (an extension's all-gather output, e.g. a TwoTensor) is wrapped as it is: its values
        # live in its inner tensors, which ``.data`` of a plain parameter cannot hold.
        param: nn.Parameter = cls(value, requires_grad=requires_grad)
        return param
    param = cls(torch.empty(0, dtype=value.dtype, device=value.device), requires_grad=requires_grad)
    _DATA.__set__(param, value)  # value's storage and geometry, the parameter's own counter
    return param


def bump_version(param: torch.Tensor) -> None:
    """The parameter's values changed under autograd: saved aliases of it now fail autograd's
    version check."""
    torch.autograd.graph.increment_version(param)


def consume_data_reads(params: Sequence[nn.Parameter], warned: set[str], names: list[str]) -> bool:
    """Whether a ``.data`` of one of ``params`` was read since the last call (the flags are
    cleared); warns once per parameter name, in ``warned``."""
    read = [i for i, p in enumerate(params) if p.__dict__.pop("_fsdp_data_read", False)]
    if not read:
        return False
    fresh = [names[i] for i in read if names[i] not in warned]
    if fresh:
        warned.update(fresh)
        warnings.warn(
            f"fsdp_engine: set_gradients_in_parameter_storage: the model read .data of "
            f"{fresh} during forward; a gradient written over the weight would be read "
            f"through it, so this group keeps its gradients beside the parameters (the "
            f"default path) for every backward after such a read. Read the weight itself, or "
            f"turn the option off for this module",
            UserWarning,
            stacklevel=2,
        )
    return True
