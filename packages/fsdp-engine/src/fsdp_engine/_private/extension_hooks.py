"""FSDP2's all-gather extension, the hooks' side: whether a local tensor defines them, the call of
``fsdp_pre_all_gather`` in the form it is defined, and the memory the gather refills
([Note: all-gather extensions] in extension_gather.py)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from fsdp_engine._private.api import MixedPrecisionPolicy

__all__ = [
    "Hooked",
    "alloc",
    "extension_hooks",
    "free",
    "pre_all_gather",
    "round_up",
    "torch_policy",
]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def extension_hooks(local: torch.Tensor) -> bool:
    """Whether ``local`` defines the extension (FSDP2's AssertionError when only one hook)."""
    pre = hasattr(local, "fsdp_pre_all_gather")
    post = hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined "
            f"if using all-gather extensions: {local}"
        )
    return pre


def alloc(tensor: torch.Tensor) -> None:
    size = tensor.numel() * tensor.itemsize
    storage = tensor.untyped_storage()
    if storage.size() != size:
        storage.resize_(size)


def free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def torch_policy(policy: MixedPrecisionPolicy) -> Any:
    """The policy as the type FSDP2 passes to ``fsdp_pre_all_gather``: torch's own class,
    bound at import (read from ``torch.distributed.fsdp`` now, it would be ours while
    ``use_as_torch_fsdp`` is on)."""
    return TorchMixedPrecisionPolicy(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        output_dtype=policy.output_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
    )


class Hooked:
    """One extension parameter's all-gather outputs and unsharded tensor ([Note: all-gather
    extensions] in extension_gather.py)."""

    def __init__(self) -> None:
        self.sizes: list[torch.Size] = []
        self.outputs: list[torch.Tensor] = []
        self.metadata: Any = None
        self.unsharded: torch.Tensor | None = None  # what the first post-hook returned
        self.inner: list[torch.Tensor] = []  # freed at reshard, re-allocated before out=


def pre_all_gather(
    local: torch.Tensor,
    mesh: DeviceMesh,
    shape: torch.Size,
    module: nn.Module,
    policy: Any,
    *,
    padded: torch.Size | None,
    world: int,
) -> tuple[Sequence[torch.Tensor], Any]:
    """``local.fsdp_pre_all_gather`` called as FSDP2 calls it: ``(mesh)`` or ``(mesh, outer_size,
    outer_stride, module, mp_policy)`` by its number of parameters (FSDP2's AssertionError
    otherwise). ``padded``: the padded chunk's size when some rank's chunk is short, which the
    five-argument form's inputs must have (FSDP2's AssertionError, raised here on every rank:
    FSDP2 raises on the short ranks only and the others hang in the all-gather)."""
    pre = local.fsdp_pre_all_gather  # type: ignore[attr-defined]
    count = len(inspect.signature(pre).parameters)
    if count not in (1, 5):
        raise AssertionError(
            f"Invalid fsdp_pre_all_gather: {inspect.signature(pre)}\n"
            "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, "
            "outer_size: torch.Size, outer_stride: tuple[int, ...], "
            "module: nn.Module, mp_policy: MixedPrecisionPolicy)"
        )
    if count == 1:
        inputs, metadata = pre(mesh)
        return tuple(inputs), metadata
    stride = torch.empty(shape, device="meta").stride()
    inputs, metadata = pre(mesh, shape, stride, module, policy)
    if padded is not None and any(t.size() != padded for t in inputs):
        raise AssertionError(
            "When a parameter is unevenly sharded by FSDP "
            f"(orig size={shape}, FSDP world size={world}), "
            "fsdp_pre_all_gather must return all-gather inputs with the padded sharded size "
            f"{padded} but got {[t.size() for t in inputs]}"
        )
    return tuple(inputs), metadata
