"""AdamW with blockwise dynamic 8-bit moments, on plain tensors and sharded parameters.

[Note: bit-identical sharded and single-device results]
Every operation of the update is elementwise in fp32 given a block's absmax, and the absmax is a
max (exact, order-free). The arithmetic avoids fused multiply-adds (no ``alpha=``, ``addcdiv``,
``lerp``) because the CPU kernels fuse in their vectorized body and not in the scalar tail, which
would make an element's result depend on its position in memory, i.e. on the shard it sits in.
Quantization blocks are counted from the *global* flat index, and the 8-bit/fp32 state decision
is made on the global numel, so a shard computes exactly the bytes the whole tensor would.

[Note: shards that cut a quantization block]
With a block-aligned sharding (a block policy from ``AdamW8bit.block_policy``) no rank boundary
cuts a block and the step issues no collective. Otherwise (e.g. FSDP2's ``Shard(0)`` with a row
length that is not a multiple of the block) at most the first and last local blocks of a rank
are shared with neighbours; their absmax is the max of the neighbours' partial maxima. Those are
computed first from just those elements, exchanged in one ``all_gather`` of 4 floats per
parameter per step (batched over all parameters of a process group, after a 16-byte
fingerprint all-gather that turns a disagreement between ranks into an error instead of a gloo
abort), and every rank stores the whole block's absmax. Results stay bit-identical to single
device; nothing else moves.

[Note: non-finite gradients]
As in ``torch.optim.AdamW`` nothing is checked: a NaN/Inf gradient element makes that element's
parameter NaN on that step. Because the moments are stored per block, the block's absmax
becomes NaN/Inf and the whole block's moments are lost (NaN) from then on, which then spreads to
the block's parameters on the next step (bitsandbytes and torchao behave the same way). Skip such
steps before ``step()`` (``torch.amp.GradScaler`` does).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, cast

import attrs
import torch
import torch.distributed as dist

from optim_blockwise._private import quant
from optim_blockwise._private.agree import check_agreement, fingerprint
from optim_blockwise._private.base import ShardedOptimizer
from optim_blockwise._private.layout import ParamLayout, local_flat
from optim_blockwise._private.policy import AdamW8bitBlockPolicy
from optim_blockwise._private.state import restore_state_dtypes, sharded_state_dict
from optim_blockwise._private.validate import check_betas, check_nonnegative

__all__ = ["AdamW8bit", "adamw8bit_block_policy"]


def adamw8bit_block_policy(
    block_size: int = 256, min_8bit_size: int = 4096
) -> AdamW8bitBlockPolicy:
    """A block policy making every shard hold whole quantization blocks (see ``AdamW8bit``)."""
    return AdamW8bitBlockPolicy(block_size, min_8bit_size)


def _moments(m: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta1: float, beta2: float) -> None:
    """In place: ``m = b1 m + (1-b1) g``, ``v = b2 v + (1-b2) g^2`` (unfused, see Note)."""
    m.mul_(beta1).add_(g * (1.0 - beta1))
    v.mul_(beta2).add_(g.mul(g).mul_(1.0 - beta2))


@attrs.frozen(eq=False)
class _Item:
    """One parameter's view for one step."""

    param: torch.Tensor
    name: str
    group: dict[str, Any]
    layout: ParamLayout
    eight_bit: bool
    exchange: bool
    """Its shards cut quantization blocks: boundary absmaxes are exchanged."""


def _cuts_blocks(layout: ParamLayout, block: int) -> bool:
    return any(lo % block for lo, hi in layout.ranges if hi > lo)


class AdamW8bit(ShardedOptimizer):
    """AdamW whose moments are stored in 8 bits with blockwise dynamic quantization.

    ``m`` uses the signed dynamic map, ``v`` the unsigned one, each block of ``block_size``
    consecutive elements (counted from the start of the *global* tensor) has one fp32 absmax;
    the update is computed in fp32. Tensors with fewer than ``min_8bit_size`` elements (decided
    on the global shape) keep fp32 moments, as bitsandbytes and torchao do.

    Works on plain tensors, ``RaggedShard`` DTensors and FSDP2 ``Shard(0)`` DTensors; with
    block-aligned shards it issues no collective. ``state_dict()`` holds each rank's local state
    (codes ``uint8``, absmaxes ``fp32``) and loads back on the same sharding.

    State memory: 2 bytes per element plus ``8 / block_size`` bytes of absmax (2.03 at 256).
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        block_size: int = 256,
        min_8bit_size: int = 4096,
    ) -> None:
        check_nonnegative("lr", lr)
        check_betas("betas", betas)
        check_nonnegative("eps", eps)
        check_nonnegative("weight_decay", weight_decay)
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)
        self.block_size = block_size
        self.min_8bit_size = min_8bit_size
        self._layouts: dict[torch.Tensor, ParamLayout] = {}

    @staticmethod
    def block_policy(block_size: int = 256, min_8bit_size: int = 4096) -> AdamW8bitBlockPolicy:
        """The block policy (engine protocol ``(name, param) -> int``) for these settings."""
        return AdamW8bitBlockPolicy(block_size, min_8bit_size)

    def state_dict(self) -> dict[str, Any]:
        """torch's format; state of DTensor params as DTensors (see the state module note)."""
        return sharded_state_dict(self, super().state_dict(), self.block_size)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        restore_state_dtypes(self, state_dict, super().load_state_dict)

    # -- helpers -----------------------------------------------------------------------------

    def _init_state(self, item: _Item) -> dict[str, Any]:
        state = cast(dict[str, Any], self.state[item.param])
        if state:
            return state
        n = item.layout.local_numel
        device = local_flat(item.param, item.name).device
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if item.eight_bit:
            head = item.layout.start % self.block_size
            nblocks = -(-(head + n) // self.block_size) if n else 0
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                zero_code = int((quant.dynamic_map(signed) == 0).nonzero()[0, 0])
                state[f"{key}_codes"] = torch.full(
                    (n,), zero_code, dtype=torch.uint8, device=device
                )
                state[f"{key}_absmax"] = torch.zeros(nblocks, dtype=torch.float32, device=device)
        else:
            state["exp_avg"] = torch.zeros(n, dtype=torch.float32, device=device)
            state["exp_avg_sq"] = torch.zeros(n, dtype=torch.float32, device=device)
        return state

    def _dequant(self, state: dict[str, Any], key: str, signed: bool, head: int) -> torch.Tensor:
        return quant.dequantize_blockwise(
            state[f"{key}_codes"], state[f"{key}_absmax"], self.block_size, signed=signed, head=head
        )

    # -- boundary absmax exchange (unaligned shards only) --------------------------------------
    def _boundary_partials(self, item: _Item, state: dict[str, Any]) -> torch.Tensor:
        """[m_head, v_head, m_tail, v_tail]: this rank's partial absmaxes of its edge blocks."""
        layout, block = item.layout, self.block_size
        n, start = layout.local_numel, layout.start
        device = state["exp_avg_absmax"].device
        if n == 0:
            return torch.zeros(4, dtype=torch.float32, device=device)
        beta1, beta2 = item.group["betas"]
        grad = item.param.grad
        assert grad is not None
        g = local_flat(grad, item.name).float()
        out = []
        tail_lo = max(((layout.stop - 1) // block) * block - start, 0)
        for lo, hi, b in ((0, min(n, block - start % block), 0), (tail_lo, n, -1)):
            edge = []
            for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                code, _ = quant._map_and_midpoints(signed, device)
                edge.append(code[state[f"{key}_codes"][lo:hi].long()] * state[f"{key}_absmax"][b])
            _moments(edge[0], edge[1], g[lo:hi], beta1, beta2)
            out += [edge[0].abs().amax(), edge[1].abs().amax()]
        return torch.stack(out)

    def _exchange_boundaries(
        self, items: list[_Item], states: list[dict[str, Any]]
    ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Global absmax of each exchanged param's first and last local block (m and v)."""
        by_group: dict[dist.ProcessGroup, list[int]] = {}
        for i, item in enumerate(items):
            if item.exchange:
                assert item.layout.group is not None
                by_group.setdefault(item.layout.group, []).append(i)
        result: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        block = self.block_size
        for group, indices in by_group.items():
            mine = torch.cat([self._boundary_partials(items[i], states[i]) for i in indices])
            digest = fingerprint(
                [(items[i].layout.global_shape, items[i].layout.ranges) for i in indices]
            )
            check_agreement(
                group,
                digest,
                len(indices),
                mine.device,
                "AdamW8bit",
                [items[i].name for i in indices],
            )
            world = dist.get_world_size(group)
            gathered = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(gathered, mine, group=group)
            table = torch.stack(gathered).view(world, len(indices), 4)
            for j, i in enumerate(indices):
                layout = items[i].layout
                if layout.local_numel == 0:
                    continue  # nothing to quantize here
                head_block = layout.start // block
                tail_block = (layout.stop - 1) // block
                # Global absmax of a block = max of every rank's partial max over that block.
                edges = []
                for target in (head_block, tail_block):
                    parts = []
                    for k, (lo, hi) in enumerate(layout.ranges):
                        if hi <= lo:
                            continue
                        if lo // block == target:
                            parts.append(table[k, j, 0:2])
                        if (hi - 1) // block == target:
                            parts.append(table[k, j, 2:4])
                    edges.append(torch.stack(parts).amax(dim=0))
                result[i] = (edges[0], edges[1])
        return result

    # -- the step ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        items: list[_Item] = []
        for group, name, param in self._params_with_grads():
            layout = self._layout(param, name)
            assert param.grad is not None
            if param.grad.shape != param.shape:
                raise ValueError(
                    f"parameter {name!r}: gradient shape {tuple(param.grad.shape)} "
                    f"differs from the parameter's {tuple(param.shape)}"
                )
            eight_bit = layout.numel >= self.min_8bit_size
            exchange = eight_bit and layout.is_sharded and _cuts_blocks(layout, self.block_size)
            items.append(_Item(param, name, group, layout, eight_bit, exchange))
        states = [self._init_state(item) for item in items]
        edges = self._exchange_boundaries(items, states)
        for i, (item, state) in enumerate(zip(items, states, strict=True)):
            self._update(item, state, edges.get(i))
        return loss

    def _update(
        self,
        item: _Item,
        state: dict[str, Any],
        edges: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> None:
        group = item.group
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        state["step"] += 1
        step = float(state["step"].item())
        p_local = local_flat(item.param, item.name)
        assert item.param.grad is not None
        g = local_flat(item.param.grad, item.name).float()
        if p_local.numel() == 0:
            return
        head = item.layout.start % self.block_size
        if item.eight_bit:
            m = self._dequant(state, "exp_avg", True, head)
            v = self._dequant(state, "exp_avg_sq", False, head)
        else:
            m, v = state["exp_avg"], state["exp_avg_sq"]
        p32 = p_local if p_local.dtype == torch.float32 else p_local.float()
        p32.mul_(1.0 - lr * wd)
        _moments(m, v, g, beta1, beta2)
        bias1 = 1.0 - beta1**step
        bias2_sqrt = math.sqrt(1.0 - beta2**step)
        denom = v.sqrt().div_(bias2_sqrt).add_(eps)
        p32.sub_(m.div(denom).mul_(lr / bias1))
        if p32 is not p_local:
            p_local.copy_(p32)
        if item.eight_bit:
            for key, value, signed, index in (("exp_avg", m, True, 0), ("exp_avg_sq", v, False, 1)):
                absmax = quant.block_absmax(value, self.block_size, head)
                if edges is not None:
                    absmax[0] = edges[0][index]
                    absmax[-1] = edges[1][index]
                state[f"{key}_absmax"] = absmax
                state[f"{key}_codes"] = quant.quantize_blockwise(
                    value, absmax, self.block_size, signed=signed, head=head
                )
