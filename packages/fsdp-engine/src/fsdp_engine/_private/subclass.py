"""Parameters whose tensor is a tensor subclass (torchao's float8 weights, a user's scaled
weight): their values in the group's storage, the subclass kept on the local tensor.

[Note: subclass parameters]
FSDP2's all-gather extension ([Note: all-gather extensions] in extension_gather.py) calls
``fsdp_pre_all_gather`` on the sharded parameter's local tensor, so that tensor must be an
instance of the user's class, as FSDP2 keeps it (FSDP2 chunks and pads the subclass itself,
through the subclass's own ops). Our values live in the group's flat storage, so the local
tensor is the subclass *wrapped around a view of that storage*, made by the subclass's own
protocol: a ``__torch_dispatch__`` wrapper subclass (``__tensor_flatten__`` /
``__tensor_unflatten__``, e.g. torchao's ``WeightWithDynamicFloat8CastTensor``) is rebuilt by
``__tensor_unflatten__`` with the view in place of the inner tensor that holds the values (the
one of the parameter's shape and dtype; the other inner tensors, e.g. a precomputed scale, are
kept). A subclass with ``__torch_function__`` only is a plain tensor after FSDP2's sharding, and
is one here too (so no hook of it is called, as in FSDP2).

The optimizer's in-place updates then reach the storage through the subclass (a wrapper forwards
them to its inner tensor), exactly as FSDP2's optimizer updates its padded subclass shard. A
wrapper whose values are not one tensor of the parameter's shape and dtype (a quantized storage
such as NF4's codes and scales) cannot live in a flat buffer of that dtype: refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["SubclassWrap", "is_subclass_tensor", "plain_values", "subclass_wrap"]


def is_subclass_tensor(value: object) -> bool:
    """A tensor of a user's ``__torch_dispatch__`` subclass (not a DTensor): the kind FSDP2
    keeps on the sharded local tensor (a subclass with ``__torch_function__`` only, like a
    ``nn.Parameter`` subclass, comes out of FSDP2's sharding as a plain tensor, and so it does
    here)."""
    cls = type(value)
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return False
    if cls is torch.Tensor or issubclass(cls, nn.Parameter):
        return False
    own = cls.__mro__[: cls.__mro__.index(torch.Tensor)]
    return any("__torch_dispatch__" in vars(k) for k in own)


def _is_wrapper(value: torch.Tensor) -> bool:
    return hasattr(type(value), "__tensor_flatten__") and hasattr(
        type(value), "__tensor_unflatten__"
    )


@attrs.frozen
class SubclassWrap:
    """How to make an instance of the parameter's subclass over a view of our storage."""

    cls: type
    attr: str  # the inner tensor holding the values
    ctx: Any = None
    others: Mapping[str, torch.Tensor] = attrs.field(factory=dict)

    def wrap(self, plain: torch.Tensor) -> torch.Tensor:
        """An instance of the subclass whose values are ``plain`` (no copy)."""
        inner = {**self.others, self.attr: plain}
        unflatten = self.cls.__tensor_unflatten__  # type: ignore[attr-defined]
        wrapped: torch.Tensor = unflatten(inner, self.ctx, plain.size(), plain.stride())
        return wrapped


def _values_attr(fqn: str, value: torch.Tensor) -> tuple[str, Any, dict[str, torch.Tensor]]:
    names, ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = {name: getattr(value, name) for name in names}
    holding = [
        name
        for name, t in inner.items()
        if isinstance(t, torch.Tensor)
        and not is_subclass_tensor(t)
        and not isinstance(t, DTensor)
        and t.shape == value.shape
        and t.dtype == value.dtype
    ]
    if len(holding) != 1:
        described = {n: (type(t).__name__, tuple(t.shape), str(t.dtype)) for n, t in inner.items()}
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a {type(value).__name__} whose values are not one "
            f"plain tensor of its shape {tuple(value.shape)} and dtype {value.dtype} (its inner "
            f"tensors: {described}); "
            "fsdp_engine holds a parameter's values in its group's flat buffer of that dtype, so "
            "subclasses with a storage of their own (e.g. quantized codes and scales) are not "
            "supported yet"
        )
    attr = holding[0]
    others = {n: t for n, t in inner.items() if n != attr}
    return attr, ctx, others


def subclass_wrap(fqn: str, value: torch.Tensor) -> SubclassWrap | None:
    """The wrap of parameter ``fqn``'s subclass (None for a plain tensor); refuses a subclass
    whose values the flat buffer cannot hold, by name."""
    if not is_subclass_tensor(value):
        return None
    if not _is_wrapper(value):
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a {type(value).__name__}, a __torch_dispatch__ "
            "subclass without __tensor_flatten__/__tensor_unflatten__: fsdp_engine keeps a "
            "subclass on the sharded parameter by rebuilding it around a view of the group's "
            "storage, which needs that protocol"
        )
    attr, ctx, others = _values_attr(fqn, value)
    return SubclassWrap(type(value), attr, ctx, others)


def plain_values(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a (local) tensor's values: itself when plain, the inner tensor
    of a wrapper subclass, a plain view of any other subclass (no copy in every case)."""
    if not is_subclass_tensor(value):
        return value
    attr, _, _ = _values_attr("<tensor>", value)
    inner: torch.Tensor = getattr(value, attr)
    return inner
