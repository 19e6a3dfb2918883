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
them to its inner tensor), exactly as FSDP2's optimizer updates its padded subclass shard.

[Note: subclasses with a storage of their own]
A wrapper whose values are not one plain tensor of the parameter's shape and dtype (several
inner tensors of that shape, like ``TwoTensor``; a quantized storage, like torchao's NF4 codes
and scales), or whose ``__tensor_unflatten__`` does not rebuild the class from our view (FSDP2
never calls it, so any signature is accepted: the older ``(inner_tensors, outer_size,
outer_stride)`` one, or one returning a plain tensor), keeps its own storage, as in FSDP2: its
local tensor is FSDP2's padded chunk, made by the subclass's own ops exactly as FSDP2 makes it
(``torch.chunk`` on dim 0, ``new_zeros`` of the padded chunk's size, ``narrow(...).copy_``,
``narrow``), and it travels only through the all-gather extension (or, without hooks, as its
padded chunk, FSDP2's all-gather input). The group's flat storage keeps a slot of the
parameter's shape for the layout and the gradients (the gradients are plain, as FSDP2's
reduce-scatter output); the values never go there. Cost against FSDP2: that slot (one padded
chunk in the parameter's dtype per rank; for NF4, four times the codes' bytes).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import attrs
import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = [
    "SubclassWrap",
    "fsdp2_chunk",
    "fsdp2_repad",
    "inner_tensors",
    "is_subclass_tensor",
    "plain_values",
    "subclass_wrap",
]


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


def _unflatten(cls: type, inner: dict[str, torch.Tensor], ctx: Any, size: Any, stride: Any) -> Any:
    """``cls.__tensor_unflatten__`` in the form it is defined: ``(inner, ctx, size, stride)``,
    or the older ``(inner, size, stride)`` (FSDP2 never calls it; we do, to rebuild the class
    over a view of our storage)."""
    unflatten = cls.__tensor_unflatten__  # type: ignore[attr-defined]
    try:
        count = len(inspect.signature(unflatten).parameters)
    except (TypeError, ValueError):  # a builtin: the current form
        count = 4
    if count == 3:
        return unflatten(inner, size, stride)
    return unflatten(inner, ctx, size, stride)


@attrs.frozen
class SubclassWrap:
    """How the parameter's subclass is kept on its local tensor: rebuilt over a view of our
    storage (``attr``: the inner tensor holding the values), or, ``attr`` None, with a storage
    of its own ([Note: subclasses with a storage of their own])."""

    cls: type
    attr: str | None  # the inner tensor holding the values; None: the subclass's own storage
    ctx: Any = None
    others: Mapping[str, torch.Tensor] = attrs.field(factory=dict)

    @property
    def owns_storage(self) -> bool:
        return self.attr is None

    def wrap(self, plain: torch.Tensor) -> torch.Tensor:
        """An instance of the subclass whose values are ``plain`` (no copy)."""
        assert self.attr is not None, "a subclass with its own storage is not rebuilt"
        inner = {**self.others, self.attr: plain}
        wrapped: torch.Tensor = _unflatten(self.cls, inner, self.ctx, plain.size(), plain.stride())
        return wrapped


def _holding(value: torch.Tensor) -> tuple[list[str], Any, dict[str, Any]]:
    """The inner tensors that hold the values (plain, of the parameter's shape and dtype)."""
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
    return holding, ctx, inner


def _values_attr(value: torch.Tensor) -> tuple[str, Any, dict[str, torch.Tensor]] | None:
    """The one inner tensor holding the values, when the class is rebuilt from our view of it
    by its ``__tensor_unflatten__``; None otherwise (the subclass keeps its own storage)."""
    holding, ctx, inner = _holding(value)
    if len(holding) != 1:
        return None
    attr = holding[0]
    try:
        rebuilt = _unflatten(type(value), inner, ctx, value.size(), value.stride())
    except Exception:  # an unflatten our call does not fit: FSDP2 never calls it
        return None
    if type(rebuilt) is not type(value):  # e.g. one returning the plain inner tensor
        return None
    others = {n: t for n, t in inner.items() if n != attr}
    return attr, ctx, others


def subclass_wrap(fqn: str, value: torch.Tensor) -> SubclassWrap | None:
    """The wrap of parameter ``fqn``'s subclass (None for a plain tensor); a ``__torch_dispatch__``
    subclass without ``__tensor_flatten__`` is refused by name."""
    if not is_subclass_tensor(value):
        return None
    if not _is_wrapper(value):
        raise NotImplementedError(
            f"fully_shard: parameter {fqn!r} is a {type(value).__name__}, a __torch_dispatch__ "
            "subclass without __tensor_flatten__/__tensor_unflatten__: fsdp_engine needs that "
            "protocol to keep a subclass on the sharded parameter"
        )
    found = _values_attr(value)
    if found is None:  # [Note: subclasses with a storage of their own]
        return SubclassWrap(type(value), None)
    attr, ctx, others = found
    return SubclassWrap(type(value), attr, ctx, others)


def plain_values(value: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding a (local) tensor's values: itself when plain, the inner tensor
    of a wrapper subclass rebuilt over our storage (no copy); a subclass with a storage of its
    own has none (ValueError)."""
    if not is_subclass_tensor(value):
        return value
    found = _values_attr(value)
    if found is None:
        raise ValueError(
            f"a {type(value).__name__} keeps its own storage: its values are not one plain tensor"
        )
    inner: torch.Tensor = getattr(value, found[0])
    return inner


def inner_tensors(value: torch.Tensor) -> list[torch.Tensor]:
    """Every plain tensor a (local) tensor's values are made of, in ``__tensor_flatten__``'s
    order, nested subclasses unpacked (itself when plain): what its bytes are."""
    if not is_subclass_tensor(value) or not _is_wrapper(value):
        return [value]
    names, _ = value.__tensor_flatten__()  # type: ignore[attr-defined]
    out: list[torch.Tensor] = []
    for name in names:
        out.extend(inner_tensors(getattr(value, name)))
    return out


def fsdp2_chunk(
    value: torch.Tensor, rank: int, world: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """FSDP2's sharding of a subclass on dim 0, through the subclass's own ops
    (``_fsdp_param.py``): this rank's ``torch.chunk`` (empty past the last chunk), copied into
    ``new_zeros`` of the padded chunk's size (chunk 0's). Returns the padded tensor and the
    local tensor (its first rows, ``narrow``), both the subclass."""
    with torch.no_grad():
        value = value.detach()
        if value.device != device and not value.is_meta:
            value = value.to(device)
        chunks = list(torch.chunk(value, world, dim=0))
        padded = value.new_zeros(chunks[0].size())
        chunk = chunks[rank] if rank < len(chunks) else None
        length = chunk.size(0) if chunk is not None and chunk.numel() > 0 else 0
        if chunk is not None and length and not padded.is_meta:
            padded.narrow(0, 0, length).copy_(chunk)
        return padded, padded.narrow(0, 0, length)


def fsdp2_repad(local: torch.Tensor, padded_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """FSDP2's ``reset_sharded_param`` for a subclass local tensor given in place of ours: its
    padded tensor (itself when it has the padded chunk's rows) and the local tensor."""
    with torch.no_grad():
        length = local.size(0) if local.numel() > 0 else 0
        if local.size(0) == padded_rows or local.is_meta:
            return local, local
        size = (padded_rows, *local.shape[1:])
        padded = local.new_zeros(size)
        if length:
            padded.narrow(0, 0, length).copy_(local)
        return padded, padded.narrow(0, 0, length)
