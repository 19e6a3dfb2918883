"""Tensor subclasses for the all-gather extension tests: a weight that all-gathers in a scaled
bf16 form and is rebuilt in the compute dtype, and a wrapper without hooks to patch them onto.

``ScaledWeight`` wraps an fp32 tensor like torchao's ``WeightWithDynamicFloat8CastTensor``:
ops unwrap it, and the ops FSDP2 uses to shard and pad it (view, slice, new_zeros, copy_...)
keep the subclass. Its ``fsdp_pre_all_gather`` (FSDP2's five-argument form) sends two inputs of
different dtypes: the local rows divided by this rank's amax, in bf16, padded to the padded
chunk, and the amax itself (fp32, one element); its ``fsdp_post_all_gather`` multiplies each
rank's rows back. The per-rank scale makes the result depend on the layout: equal to FSDP2's
only if every rank holds FSDP2's chunk. ``CALLS`` counts the hooks' calls by kind.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

CALLS: Counter[str] = Counter()

_PRESERVE = {
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.copy_.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.clone.default,
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
}


class Tagged(torch.Tensor):
    """A wrapper subclass of an fp32 tensor without hooks: tests patch them onto it."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Tagged:
        out: Tagged = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
            requires_grad=data.requires_grad,
        )
        out._data = data
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"{type(self).__name__}({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map_only(Tagged, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _PRESERVE:
            return out
        return pytree.tree_map_only(torch.Tensor, cls, out)

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @classmethod
    def __tensor_unflatten__(
        cls, inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any
    ) -> Tagged:
        return cls(inner["_data"])


class ScaledWeight(Tagged):
    """All-gathers in a scaled bf16 form (module docstring)."""

    def fsdp_pre_all_gather(
        self,
        mesh: Any,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: Any,
    ) -> tuple[tuple[torch.Tensor, ...], Any]:
        CALLS["pre"] += 1
        CALLS[f"pre_mesh_size_{mesh.size()}"] += 1
        CALLS[f"pre_module_{type(module).__name__}"] += 1
        CALLS[f"pre_outer_{tuple(outer_size)}_{tuple(outer_stride)}"] += 1
        CALLS[f"pre_policy_{type(mp_policy).__module__.split('.')[0]}"] += 1
        data = self._data
        world = mesh.size()
        padded = -(-outer_size[0] // world)
        amax = data.abs().amax() if data.numel() else torch.zeros((), dtype=data.dtype)
        scale = amax.clamp(min=1e-12).float().reshape(1)
        rows = torch.zeros((padded, *data.shape[1:]), dtype=torch.bfloat16, device=data.device)
        rows[: data.shape[0]] = (data / scale).to(torch.bfloat16)
        return (rows, scale), (padded,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        rows, scales = all_gather_outputs
        (padded,) = metadata
        world = scales.numel()
        full = rows.view(world, padded, -1).to(param_dtype) * scales.view(world, 1, 1).to(
            param_dtype
        )
        full = full.reshape(world * padded, *rows.shape[1:])
        if out is not None:
            CALLS["post_out"] += 1
            with torch.no_grad():
                out.copy_(full[: out.shape[0]])
            return None
        CALLS["post"] += 1
        return full, (full,)


def tagged_pre_all_gather(self: torch.Tensor, mesh: Any) -> tuple[tuple[torch.Tensor], Any]:
    """The older one-argument form: all-gathers the values negated, with no metadata."""
    CALLS["tagged_pre"] += 1
    assert isinstance(self, Tagged)
    return (-self._data,), None


def tagged_post_all_gather(
    self: torch.Tensor,
    all_gather_outputs: tuple[torch.Tensor, ...],
    metadata: Any,
    param_dtype: torch.dtype,
    *,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
    (values,) = all_gather_outputs
    restored = (-values).to(param_dtype)
    if out is not None:
        CALLS["tagged_post_out"] += 1
        with torch.no_grad():
            out.copy_(restored[: out.shape[0]])
        return None
    CALLS["tagged_post"] += 1
    return restored, (restored,)
