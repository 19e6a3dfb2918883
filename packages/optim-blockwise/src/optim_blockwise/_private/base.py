"""What every optimizer of the package shares: parameter names, cached layouts, the step
skeleton (closure, plan once per layout), host-side step counts, sharded state dicts.

[Note: the step skeleton]
``ShardedOptimizer.step`` is the same for ``AdamW8bit``, ``Muon``, ``Shampoo`` and ``SOAP``:

1. the closure, if any, runs under ``torch.enable_grad`` (``torch.optim``'s contract);
2. ``_plan_inputs()`` gives a cheap host-side key of everything the optimizer's plan depends on
   (its parameters, their ``requires_grad``, the settings that shape the plan), reading
   nothing from the device. When it differs from the key of the last plan, ``_make_plan()``
   runs. It is the only place where the ranks check with a collective that they agree, so the
   key may hold only what changes on every rank at once (parameters and settings, never a data
   pointer or anything else rank-local): otherwise one rank would run the agreement collective
   while the others run the step's own;
3. ``_step()`` does the update, without reading anything from the device.

[Note: host step counts]
torch keeps ``state["step"]`` as a CPU scalar tensor, and the optimizers need its value as a
number (bias corrections, run grouping). ``_step_counts`` mirrors it on the host: set when the
state is made, read from the tensor once after a load, then advanced together with the tensor,
so a steady-state step never calls ``item()``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from optim_blockwise._private.layout import ParamLayout, describe
from optim_blockwise._private.state import restore_state_dtypes, sharded_state_dict

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose parameters may be plain, RaggedShard or Shard(0).

    Subclasses give ``_plan_inputs``, ``_make_plan`` and ``_step`` (the step skeleton note)."""

    def __init__(self, params: Any, defaults: dict[str, Any]) -> None:
        self._layouts: dict[torch.Tensor, ParamLayout] = {}
        self._step_counts: dict[torch.Tensor, float] = {}
        self._plan_key: tuple[object, ...] | None = None
        super().__init__(params, defaults)

    # -- the step skeleton -------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        key = self._plan_inputs()
        if key != self._plan_key:
            self._make_plan()
            self._plan_key = key
        self._step()
        return loss

    def _plan_inputs(self) -> tuple[object, ...]:
        """Everything the plan depends on, the same change on every rank (see the note)."""
        raise NotImplementedError

    def _make_plan(self) -> None:
        """Make (and have the ranks agree on) the plan for the current parameters."""
        raise NotImplementedError

    def _step(self) -> None:
        """One update of every parameter with a gradient, after the plan is made."""
        raise NotImplementedError

    # -- parameters ----------------------------------------------------------------------------
    def _name(self, group: dict[str, Any], index: int, param: torch.Tensor) -> str:
        names = group.get("param_names")
        if names is not None:
            return str(names[index])
        gi = next(i for i, g in enumerate(self.param_groups) if g is group)
        return f"param_groups[{gi}]['params'][{index}] (shape {tuple(param.shape)})"

    def _layout(self, param: torch.Tensor, name: str) -> ParamLayout:
        layout = self._layouts.get(param)
        if layout is None:
            layout = describe(param, name)
            self._layouts[param] = layout
        return layout

    def _params_with_grads(self) -> Iterator[tuple[dict[str, Any], str, torch.Tensor]]:
        """``(group, name, param)`` of every parameter with a gradient, in group order."""
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                name = self._name(group, index, param)
                if param.grad.is_sparse:
                    raise RuntimeError(
                        f"parameter {name!r}: {type(self).__name__} does not support sparse "
                        f"gradients (as torch.optim.AdamW)"
                    )
                yield group, name, param

    # -- step counts (the host step counts note) -------------------------------------------------
    def _new_step_count(self, param: torch.Tensor, state: dict[str, Any]) -> None:
        """Start ``param``'s count at 0: ``state["step"]`` a CPU scalar, as torch keeps it."""
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        self._step_counts[param] = 0.0

    def _steps_done(self, param: torch.Tensor, state: dict[str, Any]) -> float:
        """``state["step"]`` as a number: the host mirror, read from the tensor once."""
        count = self._step_counts.get(param)
        if count is None:
            count = float(state["step"].item())
            self._step_counts[param] = count
        return count

    def _count_steps(self, entries: Sequence[tuple[torch.Tensor, dict[str, Any]]]) -> None:
        """One more step for every ``(param, state)``: the tensors (one foreach add) and their
        host mirrors."""
        for param, state in entries:
            self._step_counts[param] = self._steps_done(param, state) + 1.0
        if entries:
            torch._foreach_add_([state["step"] for _, state in entries], 1.0)

    # -- state dicts -------------------------------------------------------------------------------
    def _absmax_block(self) -> int | None:
        """The block of per-block (``*_absmax``) state, if the optimizer keeps any."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """torch's format; state of DTensor params as DTensors (see the state module note)."""
        return sharded_state_dict(self, super().state_dict(), self._absmax_block())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, with the state tensors kept in their dtypes (the state module note)."""
        restore_state_dtypes(self, state_dict, super().load_state_dict)
        self._step_counts.clear()
