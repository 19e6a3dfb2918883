"""What the DTensor integration's parts share (compat.py installs them): its error, the torch
objects it captured, and the checks and change records ``install`` builds from them."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

from ragged_dtensor._private.placement import (
    RaggedShard,
)

SUPPORTED_TORCH = (2, 13)
_TORCH_ROOT = str(Path(torch.__file__).resolve().parent)


class DTensorIntegrationError(RuntimeError):
    """The DTensor integration cannot be installed or removed: the torch version is not supported,
    or a function it wraps is not the one torch ships (the message names it)."""


@attrs.frozen
class _Originals:
    """torch's objects, checked and captured by ``install`` (the hooks call these)."""

    redistribute: Callable[..., torch.Tensor]
    propagate: Callable[[OpSchema], OutputSharding]
    tensor_meta: Callable[[OpSchema], Any]
    slow_path: Callable[..., Any]
    distribute_tensors: Callable[..., None]


_ORIGINALS: _Originals | None = None


def _torch_functions() -> _Originals:
    if _ORIGINALS is None:
        raise DTensorIntegrationError(
            "ragged_dtensor: a ragged DTensor is used while the DTensor integration is not "
            "installed; construct a RaggedShard or call install_dtensor_integration() first"
        )
    return _ORIGINALS


def _spec_has_ragged(spec: DTensorSpec) -> bool:
    return any(isinstance(p, RaggedShard) for p in spec.placements)


_REFUSING = "Refusing to install the DTensor integration (nothing was changed)."


def _describe(value: object) -> str:
    code = getattr(getattr(value, "__func__", value), "__code__", None)
    where = f" (defined in {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
    return f"{value!r}{where}"


def _expect_torch_function(
    value: object, where: str, module: str, qualname: str, parameters: Sequence[str]
) -> Callable[..., Any]:
    """``value`` if it is torch's own ``module.qualname`` with these leading parameters, else
    raise naming ``where`` (the attribute that holds it)."""
    fn = value.__func__ if isinstance(value, types.MethodType) else value
    if not (
        isinstance(fn, types.FunctionType)
        and fn.__module__ == module
        and fn.__qualname__ == qualname
        and not hasattr(fn, "__wrapped__")
        and str(Path(fn.__code__.co_filename).resolve()).startswith(_TORCH_ROOT)
    ):
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not torch's {module}.{qualname} but "
            f"{_describe(value)}; another library may have replaced or wrapped it. {_REFUSING}"
        )
    found = list(inspect.signature(fn).parameters)
    if found[: len(parameters)] != list(parameters):
        raise DTensorIntegrationError(
            f"ragged_dtensor: torch's {module}.{qualname} ({where}) takes parameters {found}, "
            f"expected {list(parameters)} first; this torch build is not supported. {_REFUSING}"
        )
    return fn


def _expect_not_on_instance(owner: object, name: str, where: str) -> None:
    """torch defines ``name`` on the class; an instance attribute is someone else's."""
    if name in vars(owner):
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not torch's method but "
            f"{_describe(vars(owner)[name])}, set on the instance by another library. "
            f"{_REFUSING}"
        )


def _check_version() -> None:
    release = torch.__version__.split("+")[0].split(".")
    if tuple(int(x) for x in release[:2] if x.isdigit()) != SUPPORTED_TORCH:
        raise DTensorIntegrationError(
            f"ragged_dtensor's DTensor integration supports torch "
            f"{'.'.join(map(str, SUPPORTED_TORCH))}.x; found torch {torch.__version__}"
        )


@attrs.frozen
class _Change:
    """One attribute the integration sets: where, the value found (``None`` with ``own=False``:
    it was inherited from the class, and removing ours restores it), and ours."""

    owner: Any
    name: str
    where: str
    own: bool
    found: Any
    ours: Any

    def apply(self) -> None:
        setattr(self.owner, self.name, self.ours)

    def still_ours(self) -> bool:
        return vars(self.owner).get(self.name, _MISSING) is self.ours

    def undo(self) -> None:
        if self.own:
            setattr(self.owner, self.name, self.found)
        else:
            delattr(self.owner, self.name)


_MISSING = object()


@attrs.frozen
class _CodeChange:
    """``function.__code__`` swapped ([Note: distribute_tensor's code])."""

    function: Any
    where: str
    found: Any
    ours: Any

    @property
    def name(self) -> str:
        return "__code__"

    def apply(self) -> None:
        self.function.__code__ = self.ours

    def still_ours(self) -> bool:
        return self.function.__code__ is self.ours

    def undo(self) -> None:
        self.function.__code__ = self.found
