"""One model, one engine: a model whose modules are sharded partly by fsdp_engine and partly by
torch's FSDP2 is refused at the root's lazy initialization, naming the modules of each.

[Note: one engine per model]
The two engines do not know each other's modules: torch's root lazily initializes only torch's
states under it, ours only ours, and each would reshard, reduce and prefetch its own modules
as if the other's were plain ones (a trainer's ``isinstance`` check on one class then silently
skips the other's modules). That happens when code bound torch's ``fully_shard`` where the
switch cannot reach it ([Note: the switch] in ``switch.py``). torch records every module its
FSDP2 (and ``replicate``) shards in its composable-state registry, so our root can look both
ways: down its own tree for torch's modules, and up, through every module torch shards, for a
torch module that holds our root.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from torch.distributed import _composable_state
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState as TorchFSDPState

__all__ = ["check_one_engine", "check_not_under_torch"]


def _torch_sharded(module: nn.Module) -> bool:
    state = _composable_state._get_module_state(module)
    return isinstance(state, TorchFSDPState)


def _torch_modules() -> list[nn.Module]:
    """Every live module torch's FSDP2 shards (its registry holds them weakly)."""
    mapping: Any = _composable_state._module_state_mapping
    out = []
    for module, ref in list(mapping.items()):
        if isinstance(ref(), TorchFSDPState):
            out.append(module)
    return out


_ADVICE = (
    "Shard every module with one engine: with fsdp_engine.use_as_torch_fsdp() on before the "
    "model is sharded, torch's names (also those a module bound at its import) are "
    "fsdp_engine's; code that reaches torch's FSDP2 otherwise (its implementation module, an "
    "object kept in a container) is not switched"
)


def check_not_under_torch(modules: list[nn.Module]) -> None:
    """``fully_shard`` on modules holding submodules torch's FSDP2 already shards: refused
    before anything is touched (their parameters are torch's DTensors)."""
    theirs = [
        name or f"<root {type(sub).__name__}>"
        for module in modules
        for name, sub in module.named_modules()
        if _torch_sharded(sub)
    ]
    if theirs:
        names = ", ".join(type(m).__name__ for m in modules)
        raise RuntimeError(
            f"fully_shard: fsdp_engine was asked to shard {names}, whose modules {theirs} are "
            f"sharded by torch's FSDP2; one model must be sharded by one engine. {_ADVICE}"
        )


def check_one_engine(root_module: nn.Module, get_state: Callable[[nn.Module], object]) -> None:
    """Raise ``RuntimeError`` when ``root_module`` (our root, lazily initializing) is part of a
    model that torch's FSDP2 shards too ([Note: one engine per model])."""
    outer = root_module
    for module in _torch_modules():
        if module is not outer and any(m is outer for m in module.modules()):
            outer = module  # a torch module above our root: name everything from there
    ours: list[str] = []
    theirs: list[str] = []
    for name, module in outer.named_modules():
        label = name or f"<root {type(module).__name__}>"
        if get_state(module) is not None:
            ours.append(label)
        elif _torch_sharded(module):
            theirs.append(label)
    if theirs:
        raise RuntimeError(
            "fully_shard: one model is sharded by two engines. fsdp_engine shards "
            f"{ours}; torch's FSDP2 shards {theirs}. Neither engine manages the other's "
            f"modules, so training would be silently wrong. {_ADVICE}"
        )
