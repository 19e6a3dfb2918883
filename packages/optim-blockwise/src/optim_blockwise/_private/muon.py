"""Muon with an AdamW path, on plain tensors and sharded parameters.

[Note: distributed Muon]
Newton-Schulz needs the whole matrix, the momentum does not. Per step:

1. every rank updates the momentum of its own shard (fp32) and forms the Nesterov update;
2. the updates travel to each matrix's owner in buckets of uneven all-to-alls (per process
   group and NS dtype, see ``exchange``); pieces travel in ``ns_dtype`` since NS casts to it
   first anyway (bf16 halves the bytes and changes nothing numerically);
3. each owner orthogonalizes its matrices of the bucket, same-shape matrices (and the experts of
   3-D weights) in one batched NS; owners are assigned once per layout, balancing NS flops and
   root memory, so every matrix is orthogonalized exactly once;
4. the results travel back in the mirror all-to-all and each rank applies its piece with the
   matrix's shape-aware learning rate.

Two gathers are kept in flight ahead of the NS: while the first ones fly, the AdamW-path
parameters are updated, weight decay is applied and unsharded matrices are orthogonalized;
afterwards each bucket's exchange runs under its neighbours' NS. The exchange plan is made once
and again only when the Muon parameters, their layouts or the groups' NS settings change (then
the ranks check they agree, see ``muon_plan``); a steady-state step has no agreement collective
and reads nothing from the device: a gradient present on some ranks only is caught by presence
flags inside the exchange and raises on every rank.

Traffic: each matrix is moved at most once each way, except the owner's own piece, i.e. at most
2x the momentum bytes per step (in ``ns_dtype``), against ``world``x for gather-to-all.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.distributed as dist

from optim_blockwise._private import exchange
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.layout import local_flat
from optim_blockwise._private.muon_plan import GroupPlan, MuonItem, on_muon_path, plan_groups
from optim_blockwise._private.muon_update import (
    adamw_foreach,
    adamw_hyper,
    as_ns_dtype,
    cast_foreach,
    check_grad,
    check_muon_settings,
    momentum_foreach,
    ns_dtype_name,
    orthogonalize,
    orthogonalize_bucket,
    scale_foreach,
    sub_scaled_foreach,
)
from optim_blockwise._private.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    adjust_lr,
)
from optim_blockwise._private.policy import MuonBlockPolicy
from optim_blockwise._private.validate import check_betas, check_nonnegative

__all__ = ["Muon", "muon_block_policy"]


def muon_block_policy(row_aligned: bool = False) -> MuonBlockPolicy:
    """Block policy of ``Muon``: 1 (no constraint), or the row length with ``row_aligned``."""
    return MuonBlockPolicy(row_aligned)


class Muon(ShardedOptimizer):
    """Muon (momentum + Newton-Schulz orthogonalization) with an AdamW path per param group.

    A param group's ``use_muon`` selects the path: ``True`` (every param must be a 2-D matrix
    or a 3-D stack of expert matrices), ``False`` (AdamW: use it for embeddings, the output
    head, norms, biases) or ``None`` (default: 2-D and 3-D params take Muon, others AdamW). A
    3-D parameter ``(E, m, n)`` is ``E`` matrices (MoE experts), each orthogonalized and scaled
    on its own, as ``E`` separate 2-D parameters would be; put other 3-D weights (e.g. conv
    kernels) in a ``use_muon=False`` group. The AdamW path uses the group's ``lr`` and
    ``weight_decay`` (or ``adamw_lr`` / ``adamw_weight_decay`` if the group sets them) and
    ``adamw_betas`` / ``adamw_eps``.

    Muon path (``torch.optim.Muon`` semantics): ``M <- b M + (1-b) G``; the update is
    ``(1-b) G + b M`` (Nesterov) or ``M``; ``O = NS(update)``; ``W <- W (1 - lr wd) - lr' O`` with
    ``lr'`` from ``adjust_lr_fn`` (``"original"``: ``sqrt(max(1, rows/cols))``;
    ``"match_rms_adamw"``: ``0.2 sqrt(max(rows, cols))``). ``ns_dtype`` is the NS precision
    (bf16 default like the reference; ``torch.float32`` is ~1e-6 accurate).

    Parameters may be plain tensors, ``RaggedShard`` DTensors or FSDP2 ``Shard(0)`` DTensors:
    see the module note for the distributed algorithm. ``bucket_cap_mb`` is the payload of one
    exchange bucket, ``in_flight`` how many gathers run ahead of the NS, ``expert_group_flops``
    the NS work of one batched group of experts of a 3-D parameter (smaller groups spread a
    parameter's experts over more owners). ``check_consistency``
    (default on) checks, when a plan is made, that every rank made the same one, and in every
    step that every rank has the same gradients (flags inside the exchange, no extra
    collective). ``state_dict()`` holds each rank's local state (fp32 momentum / moments of its
    shard) as DTensors that reshard through distributed checkpointing.
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
        bucket_cap_mb: float = 1.0,
        in_flight: int = 2,
        expert_group_flops: int = 2**24,
    ) -> None:
        check_nonnegative("lr", lr)
        check_nonnegative("weight_decay", weight_decay)
        check_nonnegative("eps", eps)
        check_betas("adamw_betas", adamw_betas)
        check_nonnegative("adamw_eps", adamw_eps)
        check_muon_settings(
            momentum, ns_steps, ns_coefficients, bucket_cap_mb, in_flight, expert_group_flops
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
            "ns_dtype": ns_dtype_name(ns_dtype),
            "adamw_betas": tuple(adamw_betas),
            "adamw_eps": adamw_eps,
            "use_muon": use_muon,
        }
        super().__init__(params, defaults)
        self.check_consistency = check_consistency
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.in_flight = in_flight
        self.expert_group_flops = expert_group_flops
        self._plans: list[GroupPlan] = []
        self._adamw_items: list[MuonItem] = []
        self.plans_made = 0
        """How many times the exchange plan was made (and agreed on): once per layout."""
        self.last_step_stats: dict[str, int] = {}
        """Collectives and bytes this rank sent in the last step (for benchmarks)."""
        for gi, group in enumerate(self.param_groups):
            if group["use_muon"] is True:
                for index, p in enumerate(group["params"]):
                    if p.dim() not in (2, 3):
                        raise ValueError(
                            f"param_groups[{gi}] has use_muon=True but parameter "
                            f"{self._name(group, index, p)!r} has shape {tuple(p.shape)}; Muon "
                            f"needs 2-D matrices or 3-D stacks of expert matrices (put others "
                            f"in a group with use_muon=False)"
                        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if "ns_dtype" in param_group:
            param_group = {**param_group, "ns_dtype": ns_dtype_name(param_group["ns_dtype"])}
        super().add_param_group(param_group)

    @staticmethod
    def block_policy(row_aligned: bool = False) -> MuonBlockPolicy:
        """The block policy (engine protocol ``(name, param) -> int``); see muon_block_policy."""
        return MuonBlockPolicy(row_aligned)

    # -- the plan ----------------------------------------------------------------------------
    def _plan_inputs(self) -> tuple[object, ...]:
        """Everything the plan depends on (see muon_plan's note); cheap, no device access."""
        key: list[object] = [self.bucket_cap_mb, self.check_consistency, self.expert_group_flops]
        for group in self.param_groups:
            key.append((group["use_muon"], group["ns_dtype"], group["ns_steps"]))
            key.extend((id(p), p.requires_grad) for p in group["params"])
        return tuple(key)

    def _make_plan(self) -> None:
        by_key: dict[tuple[dist.ProcessGroup | None, torch.dtype], list[MuonItem]] = {}
        adamw: list[MuonItem] = []
        for group in self.param_groups:
            for index, param in enumerate(group["params"]):
                if not on_muon_path(group, param):
                    name = self._name(group, index, param)
                    adamw.append(MuonItem(param, name, group, self._layout(param, name)))
                    continue
                if not param.requires_grad:
                    continue
                if param.dim() not in (2, 3):
                    raise ValueError(
                        f"parameter {self._name(group, index, param)!r} has shape "
                        f"{tuple(param.shape)}; Muon needs 2-D matrices or 3-D stacks of "
                        f"expert matrices (put others in a group with use_muon=False)"
                    )
                name = self._name(group, index, param)
                layout = self._layout(param, name)
                pg = layout.group if layout.is_sharded else None
                dtype = as_ns_dtype(group["ns_dtype"])
                by_key.setdefault((pg, dtype), []).append(MuonItem(param, name, group, layout))
        plans = plan_groups(
            by_key,
            bucket_cap_mb=self.bucket_cap_mb,
            expert_group_flops=self.expert_group_flops,
            check=self.check_consistency,
        )
        self._plans = plans
        self._adamw_items = adamw
        self.plans_made += 1

    # -- the step ----------------------------------------------------------------------------
    def _step(self) -> None:
        updates: dict[int, torch.Tensor | None] = {}
        stats = {"collectives": 0, "bytes_sent": 0}
        sharded = [gp for gp in self._plans if gp.exchange is not None]
        local = [gp for gp in self._plans if gp.exchange is None]

        def overlap() -> None:
            # Everything that needs no owner: it runs while the first gathers fly.
            self._adamw([item for item in self._adamw_items if item.param.grad is not None])
            decays: dict[float, list[torch.Tensor]] = {}
            for gp in self._plans:
                for item in gp.items:
                    if item.param.grad is None:
                        continue
                    decay = 1.0 - item.group["lr"] * item.group["weight_decay"]
                    if decay != 1.0:
                        decays.setdefault(decay, []).append(local_flat(item.param, item.name))
            for decay, tensors in decays.items():
                scale_foreach(tensors, decay)
            for gp in local:
                self._orthogonalize_locally(gp, updates)

        if not sharded:
            overlap()
        for n, gp in enumerate(sharded):
            assert gp.exchange is not None
            run = gp.exchange.run(
                piece=functools.partial(self._piece, gp, updates=updates),
                compute=functools.partial(orthogonalize_bucket, gp),
                apply=functools.partial(self._apply_bucket, gp),
                present=[gp.items[u.item].param.grad is not None for u in gp.units],
                overlap=overlap if n == 0 else None,
                in_flight=self.in_flight,
            )
            stats["collectives"] += run.collectives
            stats["bytes_sent"] += run.bytes_sent
        self.last_step_stats = stats

    def _update(
        self, gp: GroupPlan, index: int, updates: dict[int, torch.Tensor | None]
    ) -> torch.Tensor | None:
        """Item ``index``'s flat update in ``ns_dtype`` (``None`` without a gradient). The first
        call of a step makes those of every item of ``gp``, with foreach kernels per momentum
        setting: momentum ``M <- b M + (1-b) G``, Nesterov ``(1-b) G + b M``."""
        key = id(gp.items[index])
        if key not in updates:
            self._updates(gp, updates)
        return updates[key]

    def _updates(self, gp: GroupPlan, updates: dict[int, torch.Tensor | None]) -> None:
        by_setting: dict[tuple[float, bool], list[tuple[MuonItem, dict[str, Any]]]] = {}
        for item in gp.items:
            grad = item.param.grad
            updates[id(item)] = None
            if grad is None:
                continue
            check_grad(item, grad)
            state = self._state(item, ("momentum_buffer",))
            setting = (item.group["momentum"], bool(item.group["nesterov"]))
            by_setting.setdefault(setting, []).append((item, state))
        self._count_steps([(i.param, s) for e in by_setting.values() for i, s in e])
        for (beta, nesterov), entries in by_setting.items():
            grads = [local_flat(cast(torch.Tensor, i.param.grad), i.name) for i, _ in entries]
            made = momentum_foreach(
                cast_foreach(grads, torch.float32),
                [s["momentum_buffer"] for _, s in entries],
                beta,
                nesterov,
            )
            for (item, _), out in zip(entries, cast_foreach(made, gp.dtype), strict=True):
                updates[id(item)] = out

    def _apply_bucket(
        self, gp: GroupPlan, bucket: exchange.Bucket, pieces: dict[int, torch.Tensor]
    ) -> None:
        self._apply(gp, pieces)

    def _piece(
        self, gp: GroupPlan, i: int, *, updates: dict[int, torch.Tensor | None]
    ) -> torch.Tensor:
        unit = gp.units[i]
        update = self._update(gp, unit.item, updates)
        lo, hi = unit.local
        if update is None:
            device = local_flat(gp.items[unit.item].param, "").device
            return torch.zeros(hi - lo, dtype=gp.dtype, device=device)
        return update[lo:hi]

    def _apply(self, gp: GroupPlan, results: dict[int, torch.Tensor]) -> None:
        """``W <- W - lr' O`` for every unit's local piece, foreach per parameter dtype."""
        by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor], list[float]]]
        by_dtype = {}
        for i, result in results.items():
            unit = gp.units[i]
            item = gp.items[unit.item]
            lo, hi = unit.local
            if hi <= lo or item.param.grad is None:  # no gradient: nothing to apply
                continue
            target = local_flat(item.param, item.name)[lo:hi]
            targets, outs, scales = by_dtype.setdefault(target.dtype, ([], [], []))
            targets.append(target)
            outs.append(result)
            scales.append(adjust_lr(item.group["lr"], item.group["adjust_lr_fn"], unit.shape))
        for targets, outs, scales in by_dtype.values():
            sub_scaled_foreach(targets, outs, scales)

    def _orthogonalize_locally(
        self, gp: GroupPlan, updates: dict[int, torch.Tensor | None]
    ) -> None:
        """Unsharded matrices: every rank holds them whole; no communication."""
        fulls: dict[int, torch.Tensor] = {}
        for i, unit in enumerate(gp.units):
            update = self._update(gp, unit.item, updates)
            if update is not None:
                lo, hi = unit.local
                fulls[i] = update[lo:hi]
        self._apply(gp, orthogonalize(gp, fulls))

    def _state(self, item: MuonItem, keys: tuple[str, ...]) -> dict[str, Any]:
        state = cast(dict[str, Any], self.state[item.param])
        if not state:
            device = local_flat(item.param, item.name).device
            self._new_step_count(item.param, state)
            for key in keys:
                state[key] = torch.zeros(
                    item.layout.local_numel, dtype=torch.float32, device=device
                )
        return state

    def _adamw(self, items: list[MuonItem]) -> None:
        """The AdamW path: foreach over the parameters sharing hyperparameters and step."""
        runs: dict[tuple[float, ...], list[tuple[MuonItem, dict[str, Any]]]] = {}
        for item in items:
            assert item.param.grad is not None
            check_grad(item, item.param.grad)
            state = self._state(item, ("exp_avg", "exp_avg_sq"))
            self._steps_done(item.param, state)
            key = adamw_hyper(item.group, self._step_counts[item.param] + 1.0)
            runs.setdefault(key, []).append((item, state))
        self._count_steps([(i.param, s) for e in runs.values() for i, s in e])
        for (lr, wd, beta1, beta2, eps, step), entries in runs.items():
            live = [(i, s) for i, s in entries if i.layout.local_numel > 0]
            if not live:
                continue
            grads = [local_flat(cast(torch.Tensor, i.param.grad), i.name) for i, _ in live]
            adamw_foreach(
                [local_flat(i.param, i.name) for i, _ in live],
                cast_foreach(grads, torch.float32),
                [s["exp_avg"] for _, s in live],
                [s["exp_avg_sq"] for _, s in live],
                (lr, wd, beta1, beta2, eps, step),
            )
