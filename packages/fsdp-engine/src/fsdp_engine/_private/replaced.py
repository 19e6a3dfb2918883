"""The parameters ``fully_shard`` replaced: an optimizer still holding them is named at its first
step.

[Note: an optimizer built before fully_shard]
``fully_shard`` registers new (sharded) parameters in place of the module's own. An optimizer
built before it holds the old ``nn.Parameter`` objects, which never get a gradient again: every
step skips them (``p.grad is None``) and the model trains nothing, silently (FSDP2 too). What
such an optimizer always does is read ``.grad`` of a parameter it holds (``step``, and
``zero_grad`` before it), and nothing else reads the gradient of an orphaned parameter. So
``fully_shard`` changes the class of each parameter it replaced to ``_ReplacedParameter``, an
``nn.Parameter`` whose ``grad`` attribute reports once: the first read (or write) warns with
``ReplacedParameterWarning``, naming that parameter and saying to build the optimizer after
``fully_shard``, and turns every watched parameter back into a plain ``nn.Parameter``.

Why this way: it works for any optimizer (torch's, foreach or fused, ``FlatAdamW``,
``optim_blockwise``'s) without knowing it, changes nothing in torch (no global optimizer hook:
those are process-wide, and importing this package must change nothing), and costs nothing per
step: the parameters the model trains are the new ones, never watched, and after the report no
parameter is. Until then it costs one ``__class__`` assignment per parameter, in ``fully_shard``.

Why a warning and not an error: the stale optimizer changes nothing (its parameters have no
gradient), so the run is not corrupted, only not learning; a warning cannot break code that reads
an old parameter's gradient for another reason, and ``warnings.filterwarnings("error",
category=fsdp_engine.ReplacedParameterWarning)`` makes it an error for those who want one.

Only plain ``nn.Parameter`` objects are watched (a tensor-parallel ``DTensor`` parameter is not:
changing the class of a tensor subclass would change its dispatch).
"""

from __future__ import annotations

import sys
import warnings
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from fsdp_engine._private.state import FSDPState

__all__ = ["ReplacedParameterWarning", "check_not_replaced_unsharded", "watch_replaced"]


class ReplacedParameterWarning(UserWarning):
    """The gradient of a parameter ``fully_shard`` replaced was read: an optimizer (or other
    code) holds the old parameter, which never gets a gradient; build it after ``fully_shard``."""


# id(original) -> (weak reference to it, its name in its fully_shard call, the call's state).
# Keyed by id: tensors compare elementwise, so they cannot be keys themselves.
_WATCHED: dict[int, tuple[weakref.ref[nn.Parameter], str, weakref.ref[FSDPState]]] = {}


class _ReplacedParameter(nn.Parameter):
    """An ``nn.Parameter`` that ``fully_shard`` replaced ([Note: an optimizer built before
    fully_shard]); never constructed, only assigned as the class of such a parameter."""

    @property
    def grad(self) -> torch.Tensor | None:
        _report(self)  # the class is nn.Parameter again: the next line reads torch's attribute
        return self.grad

    @grad.setter
    def grad(self, value: torch.Tensor | None) -> None:
        _report(self)
        self.grad = value


def watch_replaced(state: FSDPState, replaced: Sequence[tuple[Any, str]]) -> None:
    """Watch the parameters ``state``'s ``fully_shard`` call replaced (``(original, fqn)``)."""
    owner = weakref.ref(state)
    for original, fqn in replaced:
        if type(original) is not nn.Parameter:
            continue  # a tensor subclass (DTensor) or an already watched parameter
        _WATCHED[id(original)] = (weakref.ref(original, _forget(id(original))), fqn, owner)
        original.__class__ = _ReplacedParameter


def _forget(key: int) -> Callable[[object], None]:
    """The weak reference's callback: a collected parameter leaves the table."""

    def callback(_: object) -> None:
        _WATCHED.pop(key, None)

    return callback


def _report(param: nn.Parameter) -> None:
    """The first read: unwatch every parameter, then warn (once) naming this one."""
    entry = _WATCHED.get(id(param))
    param.__class__ = nn.Parameter
    if entry is None or entry[0]() is not param:
        return  # a copy of a watched parameter (deepcopy keeps the class): not replaced
    for ref, _, _ in list(_WATCHED.values()):
        held = ref()
        if held is not None:
            held.__class__ = nn.Parameter
    _WATCHED.clear()
    _, fqn, owner = entry
    name = _root_name(owner(), fqn)
    warnings.warn(
        f"fsdp_engine: the gradient of parameter {name} was read, but fully_shard replaced "
        f"that parameter with a sharded one: the old parameter never gets a gradient, so an "
        f"optimizer holding it (this is its first step or zero_grad) updates nothing. Build "
        f"the optimizer after fully_shard, from model.parameters() (FSDP2 has the same "
        f"contract; it does not say so)",
        ReplacedParameterWarning,
        stacklevel=_user_stacklevel(),
    )


def _root_name(state: FSDPState | None, fqn: str) -> str:
    """The parameter's name in the root module when the root is known (after its first
    forward), else its name in the module given to ``fully_shard``."""
    if state is None:
        return repr(fqn)
    where = f"{fqn!r} of the {type(state.module).__name__} given to fully_shard"
    root = state.root
    if root is None:
        return where
    names = {id(p): n for n, p in root.module.named_parameters(remove_duplicate=False)}
    for group in state.groups:
        for param in group.params:
            if param.fqn == fqn and id(param.sharded) in names:
                return repr(names[id(param.sharded)])
    return where


_SKIPPED = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parent))


def _user_stacklevel() -> int:
    """The warning's stack level of the first frame outside torch and this package (the
    ``opt.step()`` line), so the default filter shows it once per call site."""
    frame = sys._getframe(1)
    level = 1
    while frame.f_back is not None and str(Path(frame.f_code.co_filename).resolve()).startswith(
        _SKIPPED
    ):
        frame = frame.f_back
        level += 1
    return level


def check_not_replaced_unsharded(params: Sequence[Any]) -> None:
    """At a reshard from the unsharded state: a parameter the user registered in place of an
    unsharded one (``module.w = nn.Parameter(...)`` between unshard and reshard) would be
    dropped by registering the sharded one; refused, naming it ([Note: registered parameters]:
    replaced while sharded, after a step, it is taken over at the next forward)."""
    for param in params:
        current = param.ref.registered()
        if current is not None and not param.is_ours(current):
            raise ValueError(
                f"parameter {param.fqn!r} was replaced while fully_shard held it unsharded "
                f"(between a forward and its backward, or kept unsharded by "
                f"reshard_after_forward/reshard_after_backward=False); the replacement would be "
                f"lost when the module reshards. Replace parameters while the module is "
                f"sharded (after optimizer.step()), where the next forward takes them over"
            )
