"""``FlatAdamW`` / ``FlatAdam``: torch's Adam(W), run on runs of parameters that lie next to each
other in one flat storage, with torch's param groups and per-parameter state.

[Note: why flat runs]
``torch.optim.AdamW`` over sharded DTensor parameters pays one DTensor dispatch per parameter and
op; on a model of many small parameters (MoE experts, norms, biases) that is a large part of the
step. A sharding engine with flat buffers (fsdp-engine's ``fully_shard``) makes the parameters of
a group views of one flat shard storage, and their reduced gradients views of one flat gradient
storage at the same offsets, so consecutive parameters of one param group form a *run* (the runs
module): one flat tensor, one flat gradient, one flat slice of each state tensor. Adam is
elementwise, so stepping a run with torch's own functional ``adam`` (the function
``torch.optim.Adam.step`` calls, with the group's hyper-parameters) gives every element exactly
the bits the per-parameter optimizer gives it, with one kernel per run instead of one per
parameter, and no DTensor dispatch.

Runs never span two param groups (each keeps its lr, betas, eps, weight decay: e.g. no decay for
norms and biases), a gap in the storage (padding, a frozen parameter, another optimizer's
parameter), gradients that are not adjacent in one storage (e.g. set by hand), or parameters at
different step counts; a parameter without a gradient this step is not stepped, and a lone
parameter is a run of one. The engine is never asked anything: its parameters are tensors, and
adjacency is read from them (storage, offset, contiguity), so any parameters work, plain ones
included; they only run faster when they are views of one storage.

[Note: per-parameter state]
The state lives in one flat buffer per storage and state key (parameters sorted by offset, gaps
dropped: ``runs.compact``), so a run's state is one slice. ``self.state[p]`` holds, for each
parameter, exactly what ``torch.optim.AdamW`` would hold: ``exp_avg`` / ``exp_avg_sq``
(/ ``max_exp_avg_sq``) as views of those buffers, DTensors with the parameter's placements for
DTensor parameters, and a scalar ``step`` (one tensor shared by the parameters of a run, which
step together). So ``state_dict()`` is torch's format, ``get_state_dict`` / distributed
checkpointing reshard it to any world size or plan like any per-parameter optimizer, and a
checkpoint of ``torch.optim.AdamW`` loads here and back. ``load_state_dict`` copies the loaded
values into the flat buffers. ``state_dict()`` gives every parameter a ``step`` of its own (a
clone of its run's): torch's optimizers load state by reference and advance each parameter's
step, so a shared one would count once per parameter of the run there.

[Note: why not a ShardedOptimizer]
The package's other optimizers share ``ShardedOptimizer``'s step skeleton, whose plan is agreed
on by the ranks and keyed on what changes on every rank at once. These two are torch's
optimizers (``isinstance(opt, torch.optim.AdamW)``, torch's state format, step dtype and
``fused`` / ``foreach`` rules), are elementwise (no plan for the ranks to agree on, no owner
exchange), and regroup their runs whenever a parameter's data pointer moves, a rank-local key
the skeleton must not hold. They share the run grouping (``runs.group_runs``) and the flat state
layout (``runs.compact``) with ``AdamW8bit`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_functional

from optim_blockwise._private.runs import (
    Slot,
    StorageKey,
    compact,
    flat_view,
    group_runs,
    local_of,
    slot_of,
)
from ragged_dtensor import from_local

__all__ = ["FlatAdam", "FlatAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


@attrs.frozen(eq=False)
class _Layout:
    """Per parameter (by id) its slot and the offset of its state in the flat state buffers of
    its storage; per storage the flat state length."""

    slots: dict[int, Slot]
    state_offsets: dict[int, int]
    sizes: dict[StorageKey, int]


def _make_layout(groups: list[dict[str, Any]]) -> _Layout:
    params = {id(p): p for group in groups for p in group["params"]}
    slots = {pid: slot_of(p) for pid, p in params.items()}
    offsets = dict(zip(slots, compact(list(slots.values())), strict=True))
    sizes: dict[StorageKey, int] = {}
    for pid, slot in slots.items():
        sizes[slot.storage] = max(sizes.get(slot.storage, 0), offsets[pid] + slot.numel)
    return _Layout(slots, offsets, sizes)


def _offset_free(value: DTensor) -> DTensor:
    """``value`` with its wrapper at storage offset 0 over the same local tensor (no copy).

    torch's DTensor wrapper takes its local tensor's storage offset and has no storage of its
    own; over a local view that starts at an offset (every state view but the first of a flat
    buffer) it reports a non-zero ``data_ptr()``, and ``torch.save`` / ``copy.deepcopy`` /
    ``dcp.async_save``'s stager, which tell a storage-less wrapper by ``data_ptr() == 0``,
    reach for its invalid storage and fail. The wrapper's offset means nothing else, so the
    state DTensors are built at offset 0, as fsdp-engine builds its parameters (its
    ``[Note: DTensors over views]``) and as every FSDP2 DTensor is."""
    if value.storage_offset() == 0:
        return value
    local = value._local_tensor
    anchor = local.detach().as_strided(local.size(), local.stride(), 0)
    rebuilt = DTensor(anchor, value._spec, requires_grad=value.requires_grad)  # type: ignore[no-untyped-call]
    rebuilt._local_tensor = local
    return rebuilt


class _FlatAdamMixin(torch.optim.Optimizer):
    """The step and state handling shared by ``FlatAdam`` and ``FlatAdamW``."""

    _layout: _Layout | None
    _layout_key: tuple[object, ...] | None
    _buffers: dict[tuple[StorageKey, str], torch.Tensor]
    _counts: dict[int, int]
    _run_steps: dict[tuple[int, int, int], torch.Tensor]
    runs_last_step: int

    def _flat_init(self) -> None:
        for gi, group in enumerate(self.param_groups):
            for flag in ("capturable", "differentiable"):
                if group.get(flag):
                    raise ValueError(
                        f"{type(self).__name__}: param_groups[{gi}] sets {flag}=True, which the "
                        f"flat path does not support; use torch.optim.{type(self).__name__[4:]}"
                    )
        self._layout = None
        self._layout_key = None
        self._buffers = {}
        self._counts = {}
        self._run_steps = {}
        self.runs_last_step = 0
        """How many runs (functional Adam calls' tensors) the last step had: a measure of
        batching (the per-parameter optimizer has one per parameter with a gradient)."""

    # -- layout and state --------------------------------------------------------------------

    def _current_layout(self) -> _Layout:
        key = tuple((id(p), local_of(p).data_ptr()) for g in self.param_groups for p in g["params"])
        if self._layout is None or key != self._layout_key:
            layout = _make_layout(self.param_groups)
            if self._layout is not None and layout.sizes != self._layout.sizes:
                self._adopt_into(layout)
            self._layout, self._layout_key = layout, key
        return self._layout

    def _buffer(self, layout: _Layout, slot: Slot, key: str) -> torch.Tensor:
        buf = self._buffers.get((slot.storage, key))
        if buf is None:
            _, dtype, device = slot.storage
            buf = torch.zeros(layout.sizes[slot.storage], dtype=dtype, device=device)
            self._buffers[(slot.storage, key)] = buf
        return buf

    def _state_slice(
        self, layout: _Layout, p: torch.Tensor, key: str, numel: int | None = None
    ) -> torch.Tensor:
        """``numel`` elements (default: ``p``'s) of the flat ``key`` buffer from ``p``'s state."""
        slot = layout.slots[id(p)]
        lo = layout.state_offsets[id(p)]
        return self._buffer(layout, slot, key)[lo : lo + (slot.numel if numel is None else numel)]

    def _state_view(self, layout: _Layout, p: torch.Tensor, key: str) -> torch.Tensor:
        """Parameter ``p``'s ``key`` state: a view of the flat buffer, shaped (and placed) like
        ``torch.zeros_like(p)``."""
        local = self._state_slice(layout, p, key).view(local_of(p).shape)
        if isinstance(p, DTensor):
            state = from_local(
                local,
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
                run_check=False,
            )
            return _offset_free(state)  # torch.save works (the note there)
        return local

    def _init_state(self, layout: _Layout, group: dict[str, Any], p: torch.Tensor) -> None:
        state = cast(dict[str, Any], self.state[p])
        if state:
            if group["amsgrad"] and "max_exp_avg_sq" not in state:
                state["max_exp_avg_sq"] = self._state_view(layout, p, "max_exp_avg_sq")
            return
        state["step"] = self._new_step(group, p, 0)
        for key in _MOMENTS + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
            state[key] = self._state_view(layout, p, key)
        self._counts[id(p)] = 0

    def _new_step(self, group: dict[str, Any], p: torch.Tensor, count: int) -> torch.Tensor:
        # torch's rule (``torch.optim.optimizer._get_scalar_dtype``): fused keeps an fp32 step
        # on the parameter's device, otherwise a CPU scalar in the default dtype (fp64 or fp32)
        if group["fused"]:
            return torch.full((), float(count), dtype=torch.float32, device=local_of(p).device)
        wide = torch.get_default_dtype() == torch.float64
        return torch.tensor(float(count), dtype=torch.float64 if wide else torch.float32)

    def _count(self, p: torch.Tensor) -> int:
        count = self._counts.get(id(p))
        if count is None:  # after a load: read once (a CPU scalar unless fused)
            count = int(self.state[p]["step"].item())
            self._counts[id(p)] = count
        return count

    def _adopt_into(self, layout: _Layout) -> None:
        """Copy every parameter's state into flat buffers of ``layout`` (after a load, or when
        parameters moved to other storages) and point ``self.state`` at them."""
        old = {p: dict(s) for p, s in self.state.items()}
        self._buffers = {}
        self._run_steps = {}
        self._counts = {}
        for group in self.param_groups:
            for p in group["params"]:
                entry = old.get(p)
                if not entry:
                    continue
                for key, value in entry.items():
                    if key == "step" or not isinstance(value, torch.Tensor):
                        continue
                    view = self._state_view(layout, p, key)
                    src = local_of(value)
                    if src.numel() != local_of(view).numel():
                        raise ValueError(
                            f"{type(self).__name__}: state {key!r} of a parameter of shape "
                            f"{tuple(p.shape)} has {src.numel()} local elements, the parameter "
                            f"{local_of(view).numel()}; load a state dict made for this layout "
                            f"(distributed checkpointing reshards it)"
                        )
                    local_of(view).copy_(src.reshape(local_of(view).shape))
                    self.state[p][key] = view
                step = entry.get("step")
                if isinstance(step, torch.Tensor):
                    self.state[p]["step"] = step.detach().clone()

    def state_dict(self) -> dict[str, Any]:
        """torch's format, each parameter with a ``step`` tensor of its own: the parameters of a
        run share one here, and ``torch.optim.AdamW`` loads a state dict by reference, so a
        shared step would be advanced once per parameter there."""
        result = super().state_dict()
        result["state"] = {
            key: (
                {**entry, "step": entry["step"].clone()}
                if isinstance(entry.get("step"), torch.Tensor)
                else entry
            )
            for key, entry in result["state"].items()
        }
        return result

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._layout = None
        self._adopt_into(self._current_layout())

    # -- the step ----------------------------------------------------------------------------

    def _runs(
        self, layout: _Layout, group: dict[str, Any]
    ) -> list[tuple[list[torch.Tensor], torch.Tensor, int]]:
        """This step's runs of ``group`` (``runs.group_runs``): parameters in storage order,
        the one whose data starts the run, element count."""
        params = [p for p in group["params"] if p.grad is not None]
        grads = [local_of(cast(torch.Tensor, p.grad)) for p in params]
        for p, grad in zip(params, grads, strict=True):
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (parameter of "
                    f"shape {tuple(p.shape)}); consider torch.optim.SparseAdam"
                )
            self._init_state(layout, group, p)  # in parameter order, as torch (state_dict order)
        runs = group_runs(
            [layout.slots[id(p)] for p in params],
            grads,
            [self._count(p) for p in params],
            empty="join",  # an empty local share only shares the run's step tensor
        )
        return [([params[i] for i in run.members], params[run.anchor], run.numel) for run in runs]

    def _run_step(self, group: dict[str, Any], gi: int, run: list[torch.Tensor]) -> torch.Tensor:
        """One step tensor shared by the run's parameters (they step together)."""
        key = (gi, id(run[0]), len(run))
        shared = self._run_steps.get(key)
        states = [self.state[p] for p in run]
        if shared is None or any(s["step"] is not shared for s in states):
            shared = self._new_step(group, run[0], self._count(run[0]))
            for s in states:
                s["step"] = shared
            self._run_steps[key] = shared
        return shared

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        layout = self._current_layout()
        total = 0
        for gi, group in enumerate(self.param_groups):
            runs = self._runs(layout, group)
            if not runs:
                continue
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            moments: dict[str, list[torch.Tensor]] = {k: [] for k in _MOMENTS}
            steps: list[torch.Tensor] = []
            maxes: list[torch.Tensor] = []
            for run, first, numel in runs:
                assert first.grad is not None
                if len(run) == 1:  # as is: any shape and strides, like the per-parameter path
                    params.append(local_of(first))
                    grads.append(local_of(first.grad))
                    for k in _MOMENTS:
                        moments[k].append(local_of(self.state[first][k]))
                    if group["amsgrad"]:
                        maxes.append(local_of(self.state[first]["max_exp_avg_sq"]))
                else:
                    params.append(flat_view(local_of(first), numel))
                    grads.append(flat_view(local_of(first.grad), numel))
                    for k in _MOMENTS:
                        moments[k].append(self._state_slice(layout, first, k, numel))
                    if group["amsgrad"]:
                        maxes.append(self._state_slice(layout, first, "max_exp_avg_sq", numel))
                steps.append(self._run_step(group, gi, run))
            beta1, beta2 = group["betas"]
            adam_functional(
                params,
                grads,
                moments["exp_avg"],
                moments["exp_avg_sq"],
                maxes,
                steps,
                amsgrad=group["amsgrad"],
                has_complex=any(torch.is_complex(p) for p in params),
                beta1=beta1,
                beta2=beta2,
                lr=group["lr"],
                weight_decay=group["weight_decay"],
                eps=group["eps"],
                maximize=group["maximize"],
                foreach=group["foreach"],
                capturable=False,
                differentiable=False,
                fused=group["fused"],
                grad_scale=getattr(self, "grad_scale", None),
                found_inf=getattr(self, "found_inf", None),
                decoupled_weight_decay=group["decoupled_weight_decay"],
            )
            for run, _, _ in runs:
                for p in run:
                    self._counts[id(p)] += 1
            total += len(runs)
        self.runs_last_step = total
        return loss


class FlatAdamW(_FlatAdamMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the same arguments and param groups, stepped on flat runs of
    parameters (see the module note): bit for bit the same parameters and state, a fraction of
    the kernels and no DTensor dispatch for parameters that are views of one storage (a
    ``fully_shard`` group's shard). ``state_dict()`` is torch's AdamW format (per parameter,
    DTensors for sharded parameters). ``capturable`` and ``differentiable`` are not
    supported."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._flat_init()


class FlatAdam(_FlatAdamMixin, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay, or ``decoupled_weight_decay=True``) with the same
    arguments and param groups, stepped on flat runs of parameters; see ``FlatAdamW``."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._flat_init()
