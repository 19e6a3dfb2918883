"""Muon with an AdamW path, on plain tensors and sharded parameters.

[Note: distributed Muon]
Newton-Schulz needs the whole matrix, the momentum does not. Per step:

1. every rank updates the momentum of its own shard (fp32) and forms the Nesterov update;
2. one uneven all-to-all (per process group, all matrices batched) sends each matrix's pieces to
   its root; pieces travel in ``ns_dtype`` since NS casts to it first anyway (bf16 halves the
   bytes and changes nothing numerically);
3. each root orthogonalizes its matrices; roots are assigned once per layout by greedy
   largest-NS-cost-first onto the least-loaded rank, so NS work is balanced and every matrix is
   orthogonalized exactly once;
4. one more all-to-all sends every rank its pieces of the results, and each rank applies its
   piece with the matrix's shape-aware learning rate.

While the gather is in flight the AdamW-path parameters are updated and weight decay is applied,
and during the scatter the next process group's work proceeds. Each step checks (one tiny
all-gather) that all ranks agree on the exchange plan, so a disagreement (e.g. a gradient that is
None on one rank only) raises a clear error instead of aborting gloo or hanging.

Traffic: each matrix is moved at most once each way, except the root's own piece, i.e. at most
2x the momentum bytes per step (in ``ns_dtype``), against ``world``x for gather-to-all.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist

from optim_blockwise._private import exchange
from optim_blockwise._private.agree import check_agreement, fingerprint
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    adjust_lr,
    assign_roots,
    newton_schulz,
    ns_flops,
)
from optim_blockwise._private.policy import MuonBlockPolicy
from optim_blockwise._private.state import restore_state_dtypes, sharded_state_dict
from optim_blockwise._private.validate import check_betas, check_nonnegative

__all__ = ["Muon", "muon_block_policy"]


def muon_block_policy(row_aligned: bool = False) -> MuonBlockPolicy:
    """Block policy of ``Muon``: 1 (no constraint), or the row length with ``row_aligned``."""
    return MuonBlockPolicy(row_aligned)


def _dtype_name(dtype: torch.dtype | str) -> str:
    """``ns_dtype`` as kept in param groups: a name (``"bfloat16"``), not a ``torch.dtype``.

    torch's ``get_state_dict(..., full_state_dict=True)`` accepts only tensors, containers and
    plain scalars in param groups, so a ``torch.dtype`` there breaks full checkpoints.
    """
    name = str(dtype).removeprefix("torch.")
    if (
        not isinstance(getattr(torch, name, None), torch.dtype)
        or not _as_dtype(name).is_floating_point
    ):
        raise ValueError(f"ns_dtype must be a floating torch dtype (or its name), got {dtype!r}")
    return name


def _as_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value)
    assert isinstance(dtype, torch.dtype)
    return dtype


@attrs.frozen(eq=False)
class _Item:
    param: torch.Tensor
    name: str
    group: dict[str, Any]
    layout: ParamLayout


@attrs.frozen
class _GroupPlan:
    plan: exchange.ExchangePlan
    fingerprint: int


class Muon(ShardedOptimizer):
    """Muon (momentum + Newton-Schulz orthogonalization) with an AdamW path per param group.

    A param group's ``use_muon`` selects the path: ``True`` (every param must be 2-D), ``False``
    (AdamW: use it for embeddings, the output head, norms, biases) or ``None`` (default: 2-D
    params take Muon, others AdamW). The AdamW path uses the group's ``lr`` and
    ``weight_decay`` (or ``adamw_lr`` / ``adamw_weight_decay`` if the group sets them) and
    ``adamw_betas`` / ``adamw_eps``.

    Muon path (``torch.optim.Muon`` semantics): ``M <- b M + (1-b) G``; the update is
    ``(1-b) G + b M`` (Nesterov) or ``M``; ``O = NS(update)``; ``W <- W (1 - lr wd) - lr' O`` with
    ``lr'`` from ``adjust_lr_fn`` (``"original"``: ``sqrt(max(1, rows/cols))``;
    ``"match_rms_adamw"``: ``0.2 sqrt(max(rows, cols))``). ``ns_dtype`` is the NS precision
    (bf16 default like the reference; ``torch.float32`` is ~1e-6 accurate).

    Parameters may be plain tensors, ``RaggedShard`` DTensors or FSDP2 ``Shard(0)`` DTensors:
    see the module note for the distributed algorithm. ``state_dict()`` holds each rank's local
    state (fp32 momentum / moments of its shard) and loads back on the same sharding.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str = "original",
        *,
        ns_dtype: torch.dtype | str = torch.bfloat16,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        use_muon: bool | None = None,
        check_consistency: bool = True,
    ) -> None:
        check_nonnegative("lr", lr)
        if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        check_nonnegative("weight_decay", weight_decay)
        check_nonnegative("eps", eps)
        check_betas("adamw_betas", adamw_betas)
        check_nonnegative("adamw_eps", adamw_eps)
        if not 0 < ns_steps < 100:
            raise ValueError(f"ns_steps must be in [1, 99], got {ns_steps}")
        if len(ns_coefficients) != 3 or not all(math.isfinite(c) for c in ns_coefficients):
            raise ValueError(
                f"ns_coefficients must be three finite numbers (a, b, c), got {ns_coefficients}"
            )
        adjust_lr(1.0, adjust_lr_fn, (1, 1))  # validates the convention
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
            "ns_dtype": _dtype_name(ns_dtype),
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "use_muon": use_muon,
        }
        super().__init__(params, defaults)
        self.check_consistency = check_consistency
        self._layouts: dict[torch.Tensor, ParamLayout] = {}
        self._plans: dict[tuple[object, ...], _GroupPlan] = {}
        self.last_step_stats: dict[str, int] = {}
        """Collectives and bytes this rank sent in the last step (for benchmarks)."""
        for gi, group in enumerate(self.param_groups):
            if group["use_muon"] is True:
                for index, p in enumerate(group["params"]):
                    if p.dim() != 2:
                        raise ValueError(
                            f"param_groups[{gi}] has use_muon=True but parameter "
                            f"{self._name(group, index, p)!r} has shape {tuple(p.shape)}; Muon "
                            f"needs 2-D matrices (put others in a group with use_muon=False)"
                        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "ns_dtype" in param_group:
            param_group = {**param_group, "ns_dtype": _dtype_name(param_group["ns_dtype"])}
        super().add_param_group(param_group)

    @staticmethod
    def block_policy(row_aligned: bool = False) -> MuonBlockPolicy:
        """The block policy (engine protocol ``(name, param) -> int``); see muon_block_policy."""
        return MuonBlockPolicy(row_aligned)

    def state_dict(self) -> dict[str, Any]:
        """torch's format; state of DTensor params as DTensors (see the state module note)."""
        return sharded_state_dict(self, super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_state_dtypes(self, state_dict, super().load_state_dict)

    # -- helpers -----------------------------------------------------------------------------

    def _state(self, item: _Item, keys: tuple[str, ...]) -> dict[str, Any]:
        state = cast(dict[str, Any], self.state[item.param])
        if not state:
            device = local_flat(item.param, item.name).device
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            for key in keys:
                state[key] = torch.zeros(
                    item.layout.local_numel, dtype=torch.float32, device=device
                )
        return state

    def _group_plan(self, items: list[_Item], pg: dist.ProcessGroup | None) -> _GroupPlan:
        key = (pg, *(item.param for item in items))
        cached = self._plans.get(key)
        if cached is not None:
            return cached
        coord = items[0].layout.coord
        world = items[0].layout.world
        for item in items:
            if item.layout.world != world or item.layout.coord != coord:
                raise ValueError(
                    f"parameter {item.name!r} ({item.layout.placement}) shares a process group "
                    f"with {items[0].name!r} but has a different axis size/coordinate"
                )
        shares = [[hi - lo for lo, hi in item.layout.ranges] for item in items]
        costs = [ns_flops(item.layout.global_shape, item.group["ns_steps"]) for item in items]
        roots = assign_roots(costs, shares)
        ranges = [item.layout.ranges for item in items]
        plan = exchange.plan_exchange(coord, ranges, roots)
        digest = fingerprint(
            [(i.layout.global_shape, i.layout.ranges, str(i.group["ns_dtype"])) for i in items]
        )
        cached = _GroupPlan(plan, digest)
        self._plans[key] = cached
        return cached

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_items: list[_Item] = []
        adamw_items: list[_Item] = []
        for group, name, param in self._params_with_grads():
            item = _Item(param, name, group, self._layout(param, name))
            use = group["use_muon"]
            if use is None:
                use = param.dim() == 2
            (muon_items if use else adamw_items).append(item)

        # 1. momentum on the local shard; the update to orthogonalize, in ns_dtype.
        updates: list[torch.Tensor] = []
        for item in muon_items:
            state = self._state(item, ("momentum_buffer",))
            state["step"] += 1
            assert item.param.grad is not None
            g = local_flat(item.param.grad, item.name).float()
            buf = state["momentum_buffer"]
            beta = item.group["momentum"]
            buf.mul_(beta).add_(g * (1.0 - beta))
            update = g.mul(1.0 - beta).add_(buf * beta) if item.group["nesterov"] else buf
            updates.append(update.to(_as_dtype(item.group["ns_dtype"])))

        by_pg: dict[dist.ProcessGroup | None, list[int]] = {}
        for i, item in enumerate(muon_items):
            pg = item.layout.group if item.layout.is_sharded else None
            by_pg.setdefault(pg, []).append(i)
        stats = {"collectives": 0, "bytes_sent": 0}

        # 2. start the gathers (one all-to-all per process group and dtype).
        pending = []
        for pg, indices in by_pg.items():
            if pg is None:
                continue
            for dtype in sorted({updates[i].dtype for i in indices}, key=str):
                sel = [i for i in indices if updates[i].dtype == dtype]
                items = [muon_items[i] for i in sel]
                gp = self._group_plan(items, pg)
                if self.check_consistency:
                    check_agreement(
                        pg,
                        gp.fingerprint,
                        len(items),
                        updates[sel[0]].device,
                        "Muon",
                        [item.name for item in items],
                    )
                    stats["collectives"] += 1
                work, recv = exchange.gather_to_roots(gp.plan, [updates[i] for i in sel], pg)
                stats["collectives"] += 1
                stats["bytes_sent"] += gp.plan.moved_elements * updates[sel[0]].element_size()
                pending.append((pg, sel, gp.plan, work, recv))

        # Overlap: AdamW-path params and Muon's weight decay while the gathers fly.
        for item in adamw_items:
            self._adamw(item)
        for item in muon_items:
            decay = 1.0 - item.group["lr"] * item.group["weight_decay"]
            if decay != 1.0:
                local_flat(item.param, item.name).mul_(decay)

        # Unsharded matrices: orthogonalize in place, no communication.
        for i in by_pg.get(None, []):
            item = muon_items[i]
            shape = item.layout.global_shape
            ortho = self._orthogonalize(item, updates[i].view(shape)).reshape(-1)
            self._apply(item, ortho)

        # 3. NS on the roots, 4. scatter back.
        scatters = []
        for pg, sel, plan, work, recv in pending:
            if work is not None:
                work.wait()
            full = exchange.assemble(plan, recv)
            results = {
                j: self._orthogonalize(
                    muon_items[sel[j]], full[j].view(muon_items[sel[j]].layout.global_shape)
                ).reshape(-1)
                for j in plan.mine
            }
            like = updates[sel[0]]
            work2, recv2 = exchange.scatter_from_roots(plan, results, like, pg)
            stats["collectives"] += 1
            stats["bytes_sent"] += plan.moved_elements * like.element_size()
            scatters.append((sel, plan, work2, recv2))
        for sel, plan, work2, recv2 in scatters:
            if work2 is not None:
                work2.wait()
            pieces = exchange.split_scattered(plan, recv2)
            for j, i in enumerate(sel):
                self._apply(muon_items[i], pieces[j])
        self.last_step_stats = stats
        return loss

    def _orthogonalize(self, item: _Item, matrix: torch.Tensor) -> torch.Tensor:
        g = item.group
        dtype = _as_dtype(g["ns_dtype"])
        return newton_schulz(matrix, g["ns_coefficients"], g["ns_steps"], g["eps"], dtype)

    def _apply(self, item: _Item, ortho_local: torch.Tensor) -> None:
        p_local = local_flat(item.param, item.name)
        if p_local.numel() == 0:
            return
        scaled = adjust_lr(item.group["lr"], item.group["adjust_lr_fn"], item.layout.global_shape)
        p_local.sub_(ortho_local.to(p_local.dtype).mul(scaled))

    def _adamw(self, item: _Item) -> None:
        group = item.group
        state = self._state(item, ("exp_avg", "exp_avg_sq"))
        state["step"] += 1
        step = float(state["step"].item())
        lr = group.get("adamw_lr")
        lr = group["lr"] if lr is None else lr
        wd = group.get("adamw_weight_decay")
        wd = group["weight_decay"] if wd is None else wd
        beta1, beta2 = group["adamw_betas"]
        eps = group["adamw_eps"]
        assert item.param.grad is not None
        g = local_flat(item.param.grad, item.name).float()
        p_local = local_flat(item.param, item.name)
        if p_local.numel() == 0:
            return
        m, v = state["exp_avg"], state["exp_avg_sq"]
        p32 = p_local if p_local.dtype == torch.float32 else p_local.float()
        p32.mul_(1.0 - lr * wd)
        m.mul_(beta1).add_(g * (1.0 - beta1))
        v.mul_(beta2).add_(g.mul(g).mul_(1.0 - beta2))
        denom = v.sqrt().div_(math.sqrt(1.0 - beta2**step)).add_(eps)
        p32.sub_(m.div(denom).mul_(lr / (1.0 - beta1**step)))
        if p32 is not p_local:
            p_local.copy_(p32)
