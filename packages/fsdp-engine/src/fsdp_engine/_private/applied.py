"""What ``fully_shard`` accepts as its module argument (FSDP2's checks and messages, before
anything is touched): an ``nn.Module`` with a ``forward``, once."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from fsdp_engine._private import compat
from fsdp_engine._private.state import get_state

__all__ = ["check_modules"]


def check_modules(modules: Sequence[object]) -> None:
    """FSDP2's contract for ``fully_shard``'s module(s):

    - a container without a ``forward`` (``nn.ModuleList``, ``nn.ModuleDict``) is refused with
      FSDP2's ``ValueError`` (its hooks would never run); in a list too, where FSDP2 checks
      nothing and fails later;
    - a module ``fully_shard`` was already applied to, by us or by torch's FSDP2 (both record it
      in torch's composable-API registry), raises FSDP2's ``AssertionError`` and says whose;
      so does a module listed twice;
    - an empty list or a non-module is a ``ValueError`` / ``TypeError`` (FSDP2 crashes inside).
    """
    if not modules:
        raise ValueError("fully_shard got an empty list of modules")
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"fully_shard expects an nn.Module, got {type(module).__name__}")
        if (
            isinstance(module, (nn.ModuleList, nn.ModuleDict))
            and type(module).forward is nn.Module.forward
        ):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {module}"
            )
        ours = get_state(module) is not None
        if ours or "fully_shard" in compat.composable_apis(module):
            who = "fsdp_engine.fully_shard" if ours else "torch.distributed.fsdp.fully_shard"
            raise AssertionError(
                "Each distinct composable distributed API can only be applied to a module once. "
                f"fully_shard has already been applied (by {who}) to the following module:\n"
                f"{module}"
            )
    if len({id(m) for m in modules}) != len(modules):
        raise AssertionError(
            "Each distinct composable distributed API can only be applied to a module once: "
            "fully_shard got the same module twice in its list"
        )
