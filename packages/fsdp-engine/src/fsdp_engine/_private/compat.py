"""The few places where the engine meets torch's private FSDP/composable machinery (torch 2.13).

[Note: why reuse torch's pieces]
- ``RegisterPostBackwardFunction``: FSDP2's autograd function over a module's forward inputs; its
  backward calls ``ctx.param_group.post_backward()`` once the inputs' gradients are computed,
  i.e. after the module's whole backward. We apply torch's own class (passing our state as the
  "param group") so that tools and tests that instrument FSDP2's post-backward see ours too; if
  torch moves it, an equivalent function of ours is used.
- the composable-API registry: ``replicate()`` skips the parameters of modules registered under
  "fully_shard" there; our modules are registered so that ``replicate(model)`` over
  ``fully_shard``-ed submodules leaves their parameters to us, like FSDP2.
- ``_apply_to_tensors``: the container traversal DDP/FSDP use for forward inputs (lists, dicts,
  namedtuples, dataclasses).
- ``in_backward``: whether autograd is running a backward now (activation-checkpoint recompute
  runs forwards inside backward; they must not reshard or reset the iteration).
Each is checked at import; ``compat_status()`` reports what is in use.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = [
    "PostBackwardFunction",
    "apply_to_tensors",
    "compat_status",
    "in_backward",
    "mark_fully_sharded",
]

_STATUS: dict[str, str] = {}


class _OwnPostBackward(torch.autograd.Function):
    """Identity on the forward inputs; its backward runs ``state.post_backward()``."""

    @staticmethod
    def forward(ctx: Any, state: Any, *inputs: torch.Tensor) -> Any:
        ctx.param_group = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        ctx.param_group.post_backward()
        return (None, *grads)


def _torch_post_backward() -> Any:
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    except ImportError:  # pragma: no cover - torch moved it
        return None
    fn = getattr(_fsdp_param_group, "RegisterPostBackwardFunction", None)
    if fn is None or not (isinstance(fn, type) and issubclass(fn, torch.autograd.Function)):
        return None  # pragma: no cover
    return fn


_TORCH_POST_BACKWARD = _torch_post_backward()
PostBackwardFunction: Any = _TORCH_POST_BACKWARD or _OwnPostBackward
_STATUS["post_backward_function"] = "torch" if _TORCH_POST_BACKWARD is not None else "own"


def _registry_tools() -> tuple[Any, Any] | None:
    try:  # the module (the package re-exports a function of the same name)
        contract = importlib.import_module("torch.distributed._composable.contract")
    except ImportError:  # pragma: no cover
        return None
    key = getattr(contract, "REGISTRY_KEY", None)
    item = getattr(contract, "RegistryItem", None)
    if not isinstance(key, str) or item is None:
        return None  # pragma: no cover
    return key, item


_REGISTRY = _registry_tools()
_STATUS["composable_registry"] = "marked" if _REGISTRY is not None else "unavailable"


def mark_fully_sharded(module: nn.Module) -> None:
    """Register ``module`` under "fully_shard" in torch's composable-API registry."""
    if _REGISTRY is None:  # pragma: no cover
        return
    key, item = _REGISTRY
    registry = module.__dict__.setdefault(key, OrderedDict())
    registry.setdefault("fully_shard", item())


def _torch_apply_to_tensors() -> Any:
    try:
        from torch.distributed.utils import _apply_to_tensors
    except ImportError:  # pragma: no cover
        return None
    return _apply_to_tensors


_APPLY = _torch_apply_to_tensors()
_STATUS["apply_to_tensors"] = "torch" if _APPLY is not None else "pytree"


def apply_to_tensors(fn: Callable[[torch.Tensor], Any], container: Any) -> Any:
    """``fn`` on every tensor of a nested container (dataclasses included), rebuilt."""
    if _APPLY is not None:
        return _APPLY(fn, container)
    from torch.utils._pytree import tree_map  # pragma: no cover

    return tree_map(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, container)


def in_backward() -> bool:
    """True while autograd runs a backward pass (on this thread)."""
    return bool(torch._C._current_graph_task_id() != -1)


def compat_status() -> dict[str, str]:
    return dict(_STATUS)
