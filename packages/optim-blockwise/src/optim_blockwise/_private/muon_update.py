"""Muon's arithmetic on many parameters at once: momentum, weight decay, the applied result and
the AdamW path, each as ``torch._foreach_*`` kernels over every parameter that shares the
hyperparameters, plus the settings checks of ``Muon``.

[Note: foreach, bit for bit]
Each foreach op is the same elementwise op as the per-tensor one it replaces (a multiply by a
Python scalar, an add, a sqrt, a divide, a dtype conversion by ``_foreach_copy_``), in the same
order, so every element's result is the one the per-parameter loop computed: on CPU the foreach
ops run the per-tensor kernels, on CUDA the multi-tensor kernels apply the same IEEE operations
in the same precision. What changes is the number of kernel launches of a step: a constant per
set of hyperparameters instead of a constant per parameter (``benchmarks/bench_launches.py``).

One exception, measured: on CPU, ``torch._foreach_mul_`` of a bf16 tensor by a Python scalar
rounds differently from ``Tensor.mul_`` (the scalar's precision inside the kernel differs), so
the two multiplications that act on parameters of a dtype other than fp32 (weight decay and the
scaled result of a Muon matrix) stay one op per tensor for those parameters. Everything computed
in fp32 (momentum, moments, the AdamW path, which updates an fp32 copy) is foreach for every
dtype. FSDP2 keeps sharded parameters in fp32 under mixed precision, so the common case is the
foreach one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from optim_blockwise._private.muon_plan import GroupPlan, MuonItem
from optim_blockwise._private.newton_schulz import newton_schulz

__all__ = [
    "adamw_foreach",
    "adamw_hyper",
    "check_grad",
    "orthogonalize",
    "orthogonalize_bucket",
    "as_ns_dtype",
    "cast_foreach",
    "check_muon_settings",
    "momentum_foreach",
    "ns_dtype_name",
    "scale_foreach",
    "sub_scaled_foreach",
]


def ns_dtype_name(dtype: torch.dtype | str) -> str:
    """``ns_dtype`` as kept in param groups: a name (``"bfloat16"``), not a ``torch.dtype``.

    torch's ``get_state_dict(..., full_state_dict=True)`` accepts only tensors, containers and
    plain scalars in param groups, so a ``torch.dtype`` there breaks full checkpoints.
    """
    name = str(dtype).removeprefix("torch.")
    if (
        not isinstance(getattr(torch, name, None), torch.dtype)
        or not as_ns_dtype(name).is_floating_point
    ):
        raise ValueError(f"ns_dtype must be a floating torch dtype (or its name), got {dtype!r}")
    return name


def as_ns_dtype(value: torch.dtype | str) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, value)
    assert isinstance(dtype, torch.dtype)
    return dtype


def check_muon_settings(
    momentum: float,
    ns_steps: int,
    ns_coefficients: tuple[float, float, float],
    bucket_cap_mb: float,
    in_flight: int,
    expert_group_flops: int,
) -> None:
    """``Muon``'s own settings (the shared ones are checked by ``validate``)."""
    if not (math.isfinite(momentum) and 0.0 <= momentum < 1.0):
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    if not 0 < ns_steps < 100:
        raise ValueError(f"ns_steps must be in [1, 99], got {ns_steps}")
    if len(ns_coefficients) != 3 or not all(math.isfinite(c) for c in ns_coefficients):
        raise ValueError(
            f"ns_coefficients must be three finite numbers (a, b, c), got {ns_coefficients}"
        )
    if not (isinstance(bucket_cap_mb, int | float) and bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a number > 0, got {bucket_cap_mb!r}")
    if not (isinstance(in_flight, int) and in_flight >= 1):
        raise ValueError(f"in_flight must be an integer >= 1, got {in_flight!r}")
    if not (isinstance(expert_group_flops, int) and expert_group_flops >= 1):
        raise ValueError(f"expert_group_flops must be an integer >= 1, got {expert_group_flops!r}")


def cast_foreach(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]`` in one flat allocation and one ``_foreach_copy_``
    (tensors already of ``dtype`` are returned as they are, as ``to`` does)."""
    if all(t.dtype == dtype for t in tensors) or not tensors:
        return list(tensors)
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=dtype, device=tensors[0].device)
    out, at = [], 0
    for t in tensors:
        out.append(flat[at : at + t.numel()].view(t.shape))
        at += t.numel()
    torch._foreach_copy_(out, list(tensors))
    return out


def momentum_foreach(
    grads: list[torch.Tensor], bufs: list[torch.Tensor], beta: float, nesterov: bool
) -> list[torch.Tensor]:
    """In place ``M <- b M + (1-b) G``; returns ``(1-b) G + b M`` (Nesterov) or ``M``."""
    torch._foreach_mul_(bufs, beta)
    torch._foreach_add_(bufs, torch._foreach_mul(grads, 1.0 - beta))
    if not nesterov:
        return bufs
    update = torch._foreach_mul(grads, 1.0 - beta)
    torch._foreach_add_(update, torch._foreach_mul(bufs, beta))
    return list(update)


def scale_foreach(tensors: list[torch.Tensor], factor: float) -> None:
    """In place ``t *= factor`` (weight decay): foreach over the fp32 tensors (see the note on
    other dtypes)."""
    fp32 = [t for t in tensors if t.dtype == torch.float32]
    if fp32:
        torch._foreach_mul_(fp32, factor)
    for t in tensors:
        if t.dtype != torch.float32:
            t.mul_(factor)


def sub_scaled_foreach(
    targets: list[torch.Tensor], results: list[torch.Tensor], scales: list[float]
) -> None:
    """``target -= result.to(target.dtype) * scale`` for every triple (one dtype of targets)."""
    if not targets:
        return
    if targets[0].dtype != torch.float32:  # see the note on other dtypes
        for target, result, scale in zip(targets, results, scales, strict=True):
            target.sub_(result.to(target.dtype).mul(scale))
        return
    cast = cast_foreach(results, targets[0].dtype)
    torch._foreach_sub_(targets, torch._foreach_mul(cast, scales))


def adamw_foreach(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    hyper: tuple[float, float, float, float, float, float],
) -> None:
    """The AdamW path's update (unfused, as ``AdamW8bit``'s), for parameters that share
    ``(lr, weight_decay, beta1, beta2, eps, step)``; parameters of other dtypes than fp32 are
    updated in fp32 and copied back."""
    lr, wd, beta1, beta2, eps, step = hyper
    p32 = cast_foreach(params, torch.float32)
    torch._foreach_mul_(p32, 1.0 - lr * wd)
    torch._foreach_mul_(exp_avgs, beta1)
    torch._foreach_add_(exp_avgs, torch._foreach_mul(grads, 1.0 - beta1))
    torch._foreach_mul_(exp_avg_sqs, beta2)
    squares = torch._foreach_mul(grads, grads)
    torch._foreach_mul_(squares, 1.0 - beta2)
    torch._foreach_add_(exp_avg_sqs, squares)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, math.sqrt(1.0 - beta2**step))
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(exp_avgs, denom)
    torch._foreach_mul_(update, lr / (1.0 - beta1**step))
    torch._foreach_sub_(p32, update)
    changed = [(p, q) for p, q in zip(params, p32, strict=True) if p is not q]
    if changed:
        torch._foreach_copy_([p for p, _ in changed], [q for _, q in changed])


def check_grad(item: MuonItem, grad: torch.Tensor) -> None:
    """A gradient Muon can use: dense, of the parameter's shape."""
    if grad.is_sparse:
        raise RuntimeError(
            f"parameter {item.name!r}: Muon does not support sparse gradients "
            f"(as torch.optim.AdamW)"
        )
    if grad.shape != item.param.shape:
        raise ValueError(
            f"parameter {item.name!r}: gradient shape {tuple(grad.shape)} differs from the "
            f"parameter's {tuple(item.param.shape)}"
        )


def adamw_hyper(group: dict[str, Any], step: float) -> tuple[float, ...]:
    """``(lr, weight_decay, beta1, beta2, eps, step)`` of the AdamW path of ``group``."""
    lr = group.get("adamw_lr")
    wd = group.get("adamw_weight_decay")
    beta1, beta2 = group["adamw_betas"]
    return (
        group["lr"] if lr is None else lr,
        group["weight_decay"] if wd is None else wd,
        beta1,
        beta2,
        group["adamw_eps"],
        step,
    )


def orthogonalize(gp: GroupPlan, fulls: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Newton-Schulz on the owner: a matrix on its own, an expert group as one batch."""
    out: dict[int, torch.Tensor] = {}
    for i, full in fulls.items():
        unit = gp.units[i]
        g = gp.items[unit.item].group
        ortho = newton_schulz(
            full.view(unit.view_shape),
            tuple(g["ns_coefficients"]),
            g["ns_steps"],
            g["eps"],
            gp.dtype,
        )
        out[i] = ortho.reshape(-1)
    return out


def orthogonalize_bucket(
    gp: GroupPlan, bucket: object, fulls: dict[int, torch.Tensor]
) -> dict[int, torch.Tensor]:
    """``orthogonalize`` as the exchange's ``compute(bucket, fulls)``."""
    return orthogonalize(gp, fulls)
