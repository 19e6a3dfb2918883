"""``FlatAdamW`` / ``FlatAdam``: torch's Adam(W), run on runs of parameters that lie next to each
other in one flat storage, with torch's param groups and per-parameter state.

[Note: why flat runs]
``torch.optim.AdamW`` over the engine's sharded parameters pays one DTensor dispatch per parameter
and op; on a model of many small parameters (MoE experts, norms, biases) that is a large part of
the step. The parameters of a ``fully_shard`` group are views of one flat shard storage (their
reduced gradients views of one flat gradient storage at the same offsets), so consecutive
parameters of the same param group form one *run*: one flat tensor, one flat gradient, one flat
slice of each state tensor. Adam is elementwise, so stepping a run with torch's own functional
``adam`` (the function ``torch.optim.Adam.step`` calls, with the group's hyper-parameters) gives
every element exactly the bits the per-parameter optimizer gives it, with one kernel per run
instead of one per parameter, and no DTensor dispatch.

Runs never span two param groups (each keeps its lr, betas, eps, weight decay: e.g. no decay for
norms and biases), a gap in the storage (padding, a frozen parameter, another optimizer's
parameter), a parameter without a gradient this step, gradients that are not adjacent in one
storage (e.g. set by hand), or parameters at different step counts; a lone parameter is a run of
one. Nothing is assumed about the engine beyond what the tensors show: any parameters work, they
only run faster when they are views of one storage.

[Note: per-parameter state]
The state lives in one flat buffer per storage and state key (parameters sorted by offset, gaps
dropped), so a run's state is one slice. ``self.state[p]`` holds, for each parameter, exactly
what ``torch.optim.AdamW`` would hold: ``exp_avg`` / ``exp_avg_sq`` (/ ``max_exp_avg_sq``) as
views of those buffers, DTensors with the parameter's placements for DTensor parameters, and a
scalar ``step`` (one tensor shared by the parameters of a run, which step together). So
``state_dict()`` is torch's format, ``get_state_dict`` / distributed checkpointing reshard it to
any world size or plan like any per-parameter optimizer, and a checkpoint of ``torch.optim.AdamW``
loads here and back. ``load_state_dict`` copies the loaded values into the flat buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
import torch
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam as adam_functional

from fsdp_engine._private import compat
from ragged_dtensor import from_local

__all__ = ["FlatAdam", "FlatAdamW"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return compat.local_tensor(t) if isinstance(t, DTensor) else t


@attrs.frozen(eq=False)
class _Slot:
    """Where one parameter's local data and state live."""

    storage: tuple[int, torch.dtype, torch.device]
    """Identity of its storage (address), dtype and device: parameters of one key share buffers."""
    offset: int
    """Element offset of its local data in the storage."""
    numel: int
    contiguous: bool
    state_offset: int = 0
    """Element offset of its state in the flat state buffers of its storage."""


@attrs.frozen(eq=False)
class _Layout:
    """Per param group, parameter indices in storage order; per parameter its slot; per storage
    the flat state length."""

    slots: dict[int, _Slot]  # id(param) -> slot
    order: tuple[tuple[int, ...], ...]  # per group: indices into group["params"], storage order
    sizes: dict[tuple[int, torch.dtype, torch.device], int]


def _slot(param: torch.Tensor) -> _Slot:
    local = _local(param)
    key = (local.untyped_storage().data_ptr(), local.dtype, local.device)
    return _Slot(key, int(local.storage_offset()), local.numel(), local.is_contiguous())


def _make_layout(groups: list[dict[str, Any]]) -> _Layout:
    slots: dict[int, _Slot] = {}
    for group in groups:
        for p in group["params"]:
            slots.setdefault(id(p), _slot(p))
    by_storage: dict[tuple[int, torch.dtype, torch.device], list[int]] = {}
    for pid, slot in slots.items():
        by_storage.setdefault(slot.storage, []).append(pid)
    sizes = {}
    for key, pids in by_storage.items():
        pos = 0
        for pid in sorted(pids, key=lambda q: (slots[q].offset, slots[q].numel)):
            slots[pid] = attrs.evolve(slots[pid], state_offset=pos)
            pos += slots[pid].numel
        sizes[key] = pos

    def storage_order(params: list[torch.Tensor]) -> tuple[int, ...]:
        def where(i: int) -> tuple[int, int]:
            slot = slots[id(params[i])]
            return (slot.storage[0], slot.offset)

        return tuple(sorted(range(len(params)), key=where))

    order = tuple(storage_order(g["params"]) for g in groups)
    return _Layout(slots, order, sizes)


def _follows(prev: _Slot, nxt: _Slot) -> bool:
    return (
        prev.storage == nxt.storage
        and prev.contiguous
        and nxt.contiguous
        and nxt.offset == prev.offset + prev.numel
    )


def _flat_view(first: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` elements of ``first``'s storage from ``first``'s start (a view of its base, so
    in-place updates bump the version counter autograd checks)."""
    return first.as_strided((numel,), (1,), first.storage_offset())


class _FlatAdamMixin(torch.optim.Optimizer):
    """The step and state handling shared by ``FlatAdam`` and ``FlatAdamW``."""

    _layout: _Layout | None
    _layout_key: tuple[object, ...] | None
    _buffers: dict[tuple[tuple[int, torch.dtype, torch.device], str], torch.Tensor]
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
        key = tuple((id(p), _local(p).data_ptr()) for g in self.param_groups for p in g["params"])
        if self._layout is None or key != self._layout_key:
            layout = _make_layout(self.param_groups)
            if self._layout is not None and layout.sizes != self._layout.sizes:
                self._adopt_into(layout)
            self._layout, self._layout_key = layout, key
        return self._layout

    def _buffer(self, layout: _Layout, slot: _Slot, key: str) -> torch.Tensor:
        buf = self._buffers.get((slot.storage, key))
        if buf is None:
            _, dtype, device = slot.storage
            buf = torch.zeros(layout.sizes[slot.storage], dtype=dtype, device=device)
            self._buffers[(slot.storage, key)] = buf
        return buf

    def _state_view(self, layout: _Layout, p: torch.Tensor, key: str) -> torch.Tensor:
        """Parameter ``p``'s ``key`` state: a view of the flat buffer, shaped (and placed) like
        ``torch.zeros_like(p)``."""
        slot = layout.slots[id(p)]
        flat = self._buffer(layout, slot, key)[slot.state_offset : slot.state_offset + slot.numel]
        local = flat.view(_local(p).shape)
        if isinstance(p, DTensor):
            state = from_local(
                local,
                p.device_mesh,
                p.placements,
                shape=p.shape,
                stride=p.stride(),
                run_check=False,
            )
            return compat.offset_free(state)  # torch.save works ([Note: DTensors over views])
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
            return torch.full((), float(count), dtype=torch.float32, device=_local(p).device)
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
                    src = _local(value)
                    if src.numel() != _local(view).numel():
                        raise ValueError(
                            f"{type(self).__name__}: state {key!r} of a parameter of shape "
                            f"{tuple(p.shape)} has {src.numel()} local elements, the parameter "
                            f"{_local(view).numel()}; load a state dict made for this layout "
                            f"(distributed checkpointing reshards it)"
                        )
                    _local(view).copy_(src.reshape(_local(view).shape))
                    self.state[p][key] = view
                step = entry.get("step")
                if isinstance(step, torch.Tensor):
                    self.state[p]["step"] = step.detach().clone()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._adopt_into(self._current_layout_fresh())

    def _current_layout_fresh(self) -> _Layout:
        self._layout = None
        return self._current_layout()

    # -- the step ----------------------------------------------------------------------------

    def _runs(
        self, layout: _Layout, gi: int, group: dict[str, Any]
    ) -> list[tuple[list[torch.Tensor], int]]:
        """This step's runs of group ``gi``: (parameters, element count) each."""
        params = group["params"]
        for p in params:  # state created in parameter order, as torch does (state_dict order)
            if p.grad is not None:
                self._init_state(layout, group, p)
        runs: list[tuple[list[torch.Tensor], int]] = []
        current: list[torch.Tensor] = []
        numel = 0
        prev_slot: _Slot | None = None
        prev_grad: torch.Tensor | None = None
        prev_count = -1
        for i in layout.order[gi]:
            p = params[i]
            grad = p.grad
            if grad is None:
                prev_slot = None
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"{type(self).__name__} does not support sparse gradients (parameter of "
                    f"shape {tuple(p.shape)}); consider torch.optim.SparseAdam"
                )
            slot = layout.slots[id(p)]
            g = _local(grad)
            count = self._count(p)
            if slot.numel == 0 and current and count == prev_count:
                current.append(p)  # nothing to compute: it only shares the run's step
                continue
            joins = (
                prev_slot is not None
                and prev_grad is not None
                and _follows(prev_slot, slot)
                and count == prev_count
                and g.is_contiguous()
                and g.dtype == prev_grad.dtype
                and g.data_ptr() == prev_grad.data_ptr() + prev_slot.numel * g.element_size()
                and g.untyped_storage().data_ptr() == prev_grad.untyped_storage().data_ptr()
            )
            if slot.numel and current and numel == 0 and count == prev_count:
                joins = True  # the run so far is empty parameters: this one anchors it
            if not joins and current:
                runs.append((current, numel))
                current, numel = [], 0
            current.append(p)
            numel += slot.numel
            prev_count = count
            if slot.numel:
                prev_slot, prev_grad = slot, g
        if current:
            runs.append((current, numel))
        return runs

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
            runs = self._runs(layout, gi, group)
            if not runs:
                continue
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            moments: dict[str, list[torch.Tensor]] = {k: [] for k in _MOMENTS}
            steps: list[torch.Tensor] = []
            maxes: list[torch.Tensor] = []
            for run, numel in runs:
                # the run's data starts at its first non-empty parameter
                first = next((p for p in run if layout.slots[id(p)].numel), run[0])
                slot = layout.slots[id(first)]
                assert first.grad is not None
                if len(run) == 1:  # as is: any shape and strides, like the per-parameter path
                    params.append(_local(first))
                    grads.append(_local(first.grad))
                    for k in _MOMENTS:
                        moments[k].append(_local(self.state[first][k]))
                    if group["amsgrad"]:
                        maxes.append(_local(self.state[first]["max_exp_avg_sq"]))
                else:
                    params.append(_flat_view(_local(first), numel))
                    grads.append(_flat_view(_local(first.grad), numel))
                    lo = slot.state_offset
                    for k in _MOMENTS:
                        moments[k].append(self._buffer(layout, slot, k)[lo : lo + numel])
                    if group["amsgrad"]:
                        maxes.append(self._buffer(layout, slot, "max_exp_avg_sq")[lo : lo + numel])
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
            for run, _ in runs:
                for p in run:
                    self._counts[id(p)] += 1
            total += len(runs)
        self.runs_last_step = total
        return loss


class FlatAdamW(_FlatAdamMixin, torch.optim.AdamW):
    """``torch.optim.AdamW`` with the same arguments and param groups, stepped on flat runs of
    parameters (see the module note): bit for bit the same parameters and state, a fraction of
    the kernels and no DTensor dispatch for ``fully_shard`` parameters. ``state_dict()`` is
    torch's AdamW format (per parameter, DTensors for sharded parameters). ``capturable`` and
    ``differentiable`` are not supported."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._flat_init()


class FlatAdam(_FlatAdamMixin, torch.optim.Adam):
    """``torch.optim.Adam`` (L2 weight decay, or ``decoupled_weight_decay=True``) with the same
    arguments and param groups, stepped on flat runs of parameters; see ``FlatAdamW``."""

    def __init__(self, params: Iterable[Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(params, *args, **kwargs)
        self._flat_init()
