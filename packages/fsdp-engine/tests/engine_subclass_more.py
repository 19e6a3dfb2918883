"""Subclasses for the tests of every wrapper subclass FSDP2 gathers: hooks for torch's
``TwoTensor`` (two inner tensors, both of the parameter's shape), a bf16-gathering wrapper
whose ``__tensor_unflatten__`` has the older three-argument form and returns the plain inner
tensor, and hooks to patch onto a local tensor object. ``CALLS`` counts what ran."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.testing._internal.two_tensor import TwoTensor

CALLS: Counter[str] = Counter()

__all__ = ["CALLS", "Bf16Gathered", "TwoTensor", "patch_two_tensor", "unpatch_two_tensor"]


def _pre_one(self: TwoTensor, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
    """The older form: both inner tensors travel, no metadata."""
    CALLS["pre_one"] += 1
    CALLS[f"mesh_ndim_{mesh.ndim}_size_{mesh.size()}"] += 1
    return (self.a, self.b), None


def _pre_five(
    self: TwoTensor, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module, policy: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """FSDP2's current form; the metadata is a tuple with a tensor and a string (passed back
    to the post-hook as given)."""
    CALLS["pre_five"] += 1
    CALLS[f"mesh_ndim_{mesh.ndim}_size_{mesh.size()}"] += 1
    return (self.a, self.b), ("two", torch.tensor([float(outer_size[0])]))


def _post(
    self: TwoTensor,
    outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    a, b = outputs
    if metadata is not None:
        tag, rows = metadata
        assert tag == "two" and int(rows.item()) == a.shape[0], (tag, rows, a.shape)
    if out is not None:
        CALLS["post_out"] += 1
        assert isinstance(out, TwoTensor), type(out)
        if a.dtype == param_dtype:  # no cast: the unsharded parameter aliases the outputs
            assert a.untyped_storage().data_ptr() == out.a.untyped_storage().data_ptr()
            assert b.untyped_storage().data_ptr() == out.b.untyped_storage().data_ptr()
        else:
            with torch.no_grad():
                out.a.copy_(a)
                out.b.copy_(b)
        return None
    CALLS["post"] += 1
    return TwoTensor(a, b).to(param_dtype), (a, b)


def patch_two_tensor(form: int) -> None:
    """Put the extension on ``TwoTensor`` (``form`` 1 or 5: the pre-hook's arguments)."""
    TwoTensor.fsdp_pre_all_gather = _pre_one if form == 1 else _pre_five  # type: ignore[attr-defined]
    TwoTensor.fsdp_post_all_gather = _post  # type: ignore[attr-defined]


def unpatch_two_tensor() -> None:
    for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
        if name in vars(TwoTensor):
            delattr(TwoTensor, name)


class Bf16Gathered(torch.Tensor):
    """Wraps ``_data``; all-gathers it in bf16 (padding its rows to the padded chunk itself
    when the parameter is unevenly sharded) and upcasts after. Its ``__tensor_unflatten__``
    takes ``(inner_tensors, outer_size, outer_stride)`` and returns the plain inner tensor
    (FSDP2 never calls it)."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Bf16Gathered:
        out: Bf16Gathered = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )
        out._data = data
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Bf16Gathered({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], outer_size: Any, outer_stride: Any
    ) -> Any:
        return inner["_data"]

    def fsdp_pre_all_gather(
        self, mesh: Any, outer_size: Any, outer_stride: Any, module: nn.Module, policy: Any
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["bf16_pre"] += 1
        rows = -(-outer_size[0] // mesh.size())
        padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16, device=self.device)
        padded[: self._data.size(0)].copy_(self._data)
        return (padded,), None

    def fsdp_post_all_gather(
        self,
        outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (gathered,) = outputs
        assert gathered.dtype == torch.bfloat16 and metadata is None
        if out is not None:
            CALLS["bf16_post_out"] += 1
            with _unsafe_preserve_version_counter(out), torch.no_grad():
                out.copy_(gathered[: out.shape[0]])
            return None
        CALLS["bf16_post"] += 1
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)


def cast_pre(
    self: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, policy: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """For patching onto a local tensor object: the values travel in bf16."""
    CALLS["instance_pre"] += 1
    return (self.to(torch.bfloat16),), None


def cast_post(
    self: torch.Tensor,
    outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    (gathered,) = outputs
    if out is not None:
        CALLS["instance_post_out"] += 1
        with _unsafe_preserve_version_counter(out), torch.no_grad():
            out.copy_(gathered)
        return None
    CALLS["instance_post"] += 1
    upcast = gathered.to(param_dtype)
    return upcast, (gathered, upcast)
