"""What both optimizers share: parameter names, cached layouts, the parameters to step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from optim_blockwise._private.layout import ParamLayout, describe

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose parameters may be plain, RaggedShard or Shard(0)."""

    _layouts: dict[torch.Tensor, ParamLayout]

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
