"""The root's lazy initialization: the first state to run forward becomes the root of every
``fully_shard`` state below it (FSDP2's ``_lazy_init``).

It checks what FSDP2 checks, with FSDP2's words: one root module, no state initialized before
its root ran, no parameter left on the meta device; and that no module of the model is sharded
by torch's FSDP2 ([Note: one engine per model]). The states of the tree then share one
``IterationContext`` and learn their names under the root; the root keeps its parameters
unsharded after forward unless the user said otherwise (backward needs them first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

from fsdp_engine._private.one_engine import check_one_engine

if TYPE_CHECKING:
    from fsdp_engine._private.state import FSDPState

__all__ = ["init_root"]


def init_root(root: FSDPState, get_state: Callable[[nn.Module], FSDPState | None]) -> None:
    """Make ``root`` (not initialized yet) the root of every state in its module tree."""
    if len(root.modules) > 1:
        names = ", ".join(type(m).__name__ for m in root.modules)
        raise RuntimeError(
            f"FSDP requires a single root module but got a fully_shard group of several "
            f"modules ({names}) as the first to run forward; fully_shard their parent"
        )
    root_module = root.modules[0]
    check_one_engine(root_module, get_state)  # [Note: one engine per model]
    root.is_root = True
    root.root = root
    ctx = root.ctx
    for name, module in root_module.named_modules():
        state = get_state(module)
        if state is None or state in ctx.all_states:
            continue
        if state is not root:
            if state.is_root is not None:
                raise RuntimeError(
                    f"fully_shard state has already been lazily initialized for {name!r}; "
                    "fully_shard requires running forward through the root module first"
                )
            state.is_root = False
            state.root = root
        ctx.all_states.append(state)
    for state in ctx.all_states:
        state.ctx = ctx
    for name, module in root_module.named_modules():
        state = get_state(module)
        if state is not None:
            state.fqn = name if state.fqn is None else f"{state.fqn}, {name}"
    if root.config.reshard_after_forward is None:
        # the root's parameters are needed again at the start of backward
        root.configure(reshard_after_forward=False)
    for state in ctx.all_states:
        for group in state.groups:
            group.fqn, group.ctx = state.fqn, ctx  # [Note: the group's lifecycle]
            group.to_sharded()
    _check_materialized(root_module, ctx.all_states)


def _check_materialized(root_module: nn.Module, states: list[FSDPState]) -> None:
    """FSDP2's check and words: the first group with parameters on the meta device."""
    fqns = {id(p): n for n, p in root_module.named_parameters(remove_duplicate=False)}
    for state in states:
        for g in state.groups:
            meta = [fqns.get(id(g.params[i].sharded), g.params[i].fqn) for i in g.meta_indices()]
            if meta:
                raise RuntimeError(
                    "FSDP parameters should be materialized from meta device before "
                    f"training, but the following were still on meta device: {meta}\n"
                    "For example, call module.to_empty(device) to materialize to device and "
                    "call module.reset_parameters() on each module to initialize values."
                )
