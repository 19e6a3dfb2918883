"""What the engine's module hooks do around a module's own forward: run outside dynamo's
graphs, cast inputs and outputs (mixed precision), and route the forward inputs through the
function whose backward is the module's post-backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch

from fsdp_engine._private import compat
from fsdp_engine._private.api import MixedPrecisionPolicy

__all__ = [
    "cast_inputs",
    "cast_output",
    "grad_tensors",
    "hidden_from_dynamo",
    "register_post_backward",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def hidden_from_dynamo(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """[Note: hooks and torch.compile]
    The hooks run eagerly, outside any graph dynamo builds of a module that ``fully_shard``
    manages (``module.compile()``), as FSDP2's do: their collectives and Python bookkeeping
    would otherwise break the graph (one break per layer, at the all-gather) or be traced into
    it. Eager calls go straight to ``fn`` (no per-call wrapper cost); while dynamo traces, the
    call is to ``torch.compiler.disable(fn)``, which dynamo runs outside the graph without
    splitting it."""

    @functools.wraps(fn)
    def hook(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        if torch.compiler.is_compiling():
            disable = torch.compiler.disable  # untyped in torch
            hidden: Callable[_P, _R] = disable(fn, recursive=True)  # type: ignore[no-untyped-call]
            return hidden(*args, **kwargs)
        return fn(*args, **kwargs)

    return hook


def grad_tensors(output: Any) -> list[torch.Tensor]:
    """The tensors of a nested container that require grad, in traversal order.

    torch's traversal (``_apply_to_tensors``) is a recursive closure, i.e. a reference cycle
    that keeps the function it was given alive until the garbage collector runs: so the list
    the callback fills is emptied before returning (a copy is returned), else the activations
    it held would outlive the step (measured: one step's outputs kept per module)."""
    found: list[torch.Tensor] = []

    def collect(t: torch.Tensor) -> torch.Tensor:
        if t.requires_grad:
            found.append(t)
        return t

    compat.apply_to_tensors(collect, output)
    result = list(found)
    found.clear()
    return result


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype:
        return value.to(dtype)
    return value


def cast_inputs(
    policy: MixedPrecisionPolicy, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Floating forward inputs in ``param_dtype`` (``cast_forward_inputs``)."""
    dtype = policy.param_dtype
    if not (policy.cast_forward_inputs and dtype is not None):
        return args, kwargs
    with torch.profiler.record_function("FSDP::cast_forward_inputs"):  # FSDP2's range
        cast = compat.apply_to_tensors(lambda x: _cast(x, dtype), (args, kwargs))
    return tuple(cast[0]), dict(cast[1])


def cast_output(policy: MixedPrecisionPolicy, output: Any) -> Any:
    """Floating outputs in ``output_dtype``, when the policy sets one."""
    dtype = policy.output_dtype
    if dtype is None:
        return output
    with torch.profiler.record_function("FSDP::cast_forward_outputs"):  # FSDP2's range
        return compat.apply_to_tensors(lambda x: _cast(x, dtype), output)


def register_post_backward(
    state: Any, has_groups: bool, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Route the forward inputs that require grad through ``PostBackwardFunction``: its
    backward (``state.post_backward()``) runs once their gradients are computed, i.e. after
    the module's whole backward."""
    if not torch.is_grad_enabled() or not has_groups:
        return args, kwargs
    found = grad_tensors((args, kwargs))
    if not found:
        return args, kwargs
    outputs = list(compat.PostBackwardFunction.apply(state, *found))
    found.clear()
    position = iter(range(len(outputs)))

    def replace(t: torch.Tensor) -> torch.Tensor:
        return outputs[next(position)] if t.requires_grad else t

    new = compat.apply_to_tensors(replace, (args, kwargs))
    outputs.clear()  # the closure outlives this call ([grad_tensors]'s cycle): hold nothing
    return tuple(new[0]), dict(new[1])
