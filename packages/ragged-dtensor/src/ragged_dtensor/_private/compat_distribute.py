"""``distribute_tensor`` in the DTensor integration ([Note: distribute_tensor's code] in compat.py):
torch's function at import, the trampoline its code object becomes, and the changes that
install it."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import _api as dtensor_api
from torch.distributed.tensor.placement_types import Placement

from ragged_dtensor._private.compat_base import (
    _REFUSING,
    DTensorIntegrationError,
    _Change,
    _CodeChange,
    _describe,
)
from ragged_dtensor._private.placement import (
    RaggedShard,
)

_TORCH_DISTRIBUTE = dtensor_api.distribute_tensor  # the object everyone bound
_TORCH_DISTRIBUTE_CODE = _TORCH_DISTRIBUTE.__code__
# torch's distribute_tensor as it is at import, callable while the public one runs ours
torch_distribute: Callable[..., DTensor] = types.FunctionType(
    _TORCH_DISTRIBUTE_CODE,
    _TORCH_DISTRIBUTE.__globals__,
    "distribute_tensor",
    _TORCH_DISTRIBUTE.__defaults__,
    _TORCH_DISTRIBUTE.__closure__,
)
torch_distribute.__kwdefaults__ = _TORCH_DISTRIBUTE.__kwdefaults__
_IMPL_NAME = "_ragged_dtensor_distribute"  # injected into torch's _api namespace while installed


def _distribute_impl(
    tensor: torch.Tensor,
    device_mesh: DeviceMesh | None,
    placements: Sequence[Placement] | None,
    src_data_rank: int | None,
) -> DTensor:
    if placements is None or not any(isinstance(p, RaggedShard) for p in placements):
        return torch_distribute(tensor, device_mesh, placements, src_data_rank=src_data_rank)
    from ragged_dtensor._private.api import distribute_ragged

    return distribute_ragged(tensor, device_mesh, placements, src_data_rank=src_data_rank)


def _distribute_trampoline(  # type: ignore[no-untyped-def]
    tensor, device_mesh=None, placements=None, *, src_data_rank=0
):
    # Runs as the code of torch's own distribute_tensor, so its globals are torch's _api
    # module's: the name below is injected there while the integration is installed.
    return _ragged_dtensor_distribute(  # type: ignore[name-defined]  # noqa: F821
        tensor, device_mesh, placements, src_data_rank
    )


def _distribute_changes() -> list[Any]:
    where = "torch.distributed.tensor.distribute_tensor"
    if vars(dtensor_api).get("distribute_tensor") is not _TORCH_DISTRIBUTE:
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not the function torch defined at import but "
            f"{_describe(vars(dtensor_api).get('distribute_tensor'))}. {_REFUSING}"
        )
    params = list(inspect.signature(_TORCH_DISTRIBUTE).parameters)
    if (
        _TORCH_DISTRIBUTE.__code__ is not _TORCH_DISTRIBUTE_CODE
        or params != ["tensor", "device_mesh", "placements", "src_data_rank"]
        or _TORCH_DISTRIBUTE_CODE.co_freevars
    ):
        raise DTensorIntegrationError(
            f"ragged_dtensor: {where} is not torch 2.13's (its code was replaced, or its "
            f"parameters are {params}). {_REFUSING}"
        )
    if _IMPL_NAME in vars(dtensor_api):
        raise DTensorIntegrationError(
            f"ragged_dtensor: torch.distributed.tensor._api already has {_IMPL_NAME}. {_REFUSING}"
        )
    return [
        _Change(
            dtensor_api,
            _IMPL_NAME,
            f"torch.distributed.tensor._api.{_IMPL_NAME}",
            False,
            None,
            _distribute_impl,
        ),
        _CodeChange(
            _TORCH_DISTRIBUTE, where, _TORCH_DISTRIBUTE_CODE, _distribute_trampoline.__code__
        ),
    ]
