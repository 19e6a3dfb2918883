"""``load_state_dict`` that keeps the optimizers' state dtypes.

``torch.optim.Optimizer.load_state_dict`` casts every floating state tensor to its parameter's
dtype, and casts integer ones too when the parameter is floating: that would turn 8-bit codes
into floats and round fp32 absmaxes/moments of a bf16 parameter to bf16. Both optimizers keep
their state dtypes by design (uint8 codes, fp32 everything else), so after torch's load we put
back the saved tensors exactly, only moved to the parameter's device.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["restore_state_dtypes"]


def restore_state_dtypes(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    load: Callable[[dict[str, Any]], None],
) -> None:
    saved_state: dict[Any, dict[str, Any]] = state_dict["state"]
    saved_groups: list[dict[str, Any]] = state_dict["param_groups"]
    load(state_dict)
    ids = itertools.chain.from_iterable(g["params"] for g in saved_groups)
    params = itertools.chain.from_iterable(g["params"] for g in optimizer.param_groups)
    for pid, param in zip(ids, params, strict=True):
        saved = saved_state.get(pid)
        if saved is None:
            continue
        target = optimizer.state[param]
        for key, value in saved.items():
            if isinstance(value, torch.Tensor):
                device = value.device if key == "step" else param.device
                target[key] = value.detach().to(device=device, copy=True)
