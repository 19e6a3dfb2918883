"""The engine states of fully_shard modules, as ``FSDPModule``'s methods find them."""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fsdp_engine._private.state import FSDPState, get_state

__all__ = ["prefetch_states", "state_of", "states_under"]


def states_under(module: object, recurse: bool) -> list[FSDPState]:
    assert isinstance(module, nn.Module)
    states: list[FSDPState] = []
    for m in module.modules() if recurse else [module]:
        state = get_state(m)
        if state is not None and state not in states:
            states.append(state)
    return states


def state_of(module: object, what: str) -> FSDPState:
    state = get_state(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(f"{what}: {type(module).__name__} is not a fully_shard module")
    return state


def prefetch_states(setter: str, modules: list[TorchFSDPModule]) -> tuple[FSDPState, ...]:
    """The states of prefetch targets: FSDP2's ``ValueError`` for anything that is not a
    fully_shard module (one torch's own FSDP2 manages is named as such)."""
    states = []
    for module in modules:
        state = get_state(module) if isinstance(module, nn.Module) else None
        if state is None:
            torchs = isinstance(module, TorchFSDPModule)
            whose = " (sharded by torch's fully_shard)" if torchs else ""
            raise ValueError(
                f"{setter}: Expects FSDPModule (a module fsdp_engine.fully_shard was applied to) "
                f"but got {type(module)}{whose}: {module}"
            )
        states.append(state)
    return tuple(states)
