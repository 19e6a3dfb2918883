"""How a gradient reduction divides: FSDP2's rule, chosen by dtype, sizes and backend capability.

[Note: dividing a mean of gradients]
A mean of gradients over the data-parallel ranks (``m`` shard ranks times ``r`` replicas) is
computed as FSDP2 computes it (``_get_gradient_divide_factors``), so the two engines round alike:

- fp32 and bf16 (no overflow risk) with no divide factor: the reduce-scatter and the replica
  all-reduce each use the backend's ``AVG``; on one data-parallel rank nothing is divided;
- a divide factor ``f`` (``set_gradient_divide_factor``): ``AVG`` on the reduce-scatter when
  ``f`` is the shard group's size, else every input is multiplied by ``1 / f`` before a ``SUM``
  (what NCCL's ``PREMUL_SUM`` computes, spelled as a multiplication so every backend runs it);
  the all-reduce sums;
- any other dtype (fp16: a small range) or ``force_sum``: ``SUM`` collectives, with the inputs
  divided by ``p`` before, ``p`` the power of two nearest below ``sqrt(f)`` that divides ``f``
  (only for dtypes at risk: summing ``m`` fp16 gradients can overflow, dividing each by ``m``
  can underflow), and the result by ``f / p`` after (``f`` defaults to ``m * r``).

Where the backend of the tensors' device has no ``AVG`` (``avg_supported``), the same mean is a
``SUM`` followed by a division by the group's size: what ``AVG`` itself computes on gloo.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.distributed as dist

__all__ = ["ReduceSpec", "avg_supported", "reduce_spec"]

Op = Literal["sum", "avg"]

# Backend classes (per device) known to reject ``ReduceOp.AVG``. Capability, not a name: the
# backend object serving the tensors' device is looked up on the process group, so a compound
# backend ("cpu:gloo,cuda:nccl") answers for the device the tensors are on.
_NO_AVG: tuple[type, ...] = tuple(
    cls for cls in (getattr(dist, "ProcessGroupMPI", None),) if isinstance(cls, type)
)
# Device types whose collectives only sum (FSDP2 forces SUM there).
_SUM_ONLY_DEVICES = frozenset({"mtia"})


def avg_supported(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether ``group``'s backend for ``device`` reduces with ``AVG``."""
    if device.type in _SUM_ONLY_DEVICES:
        return False
    try:
        backend = group._get_backend(device)
    except (RuntimeError, ValueError, AttributeError):  # no backend for that device, or a fake
        return True
    return not isinstance(backend, _NO_AVG)


@attrs.frozen
class ReduceSpec:
    """One reduction's arithmetic ([Note: dividing a mean of gradients]).

    ``pre_divide`` / ``post_divide``: divide the input before / the result after (None: no
    division); ``premul_factor``: ``f`` of a divide factor, each input multiplied by ``1 / f``
    before a sum (divided by ``f`` where one rank copies instead of reducing);
    ``scatter_op`` / ``all_reduce_op``: the reduce-scatter's and the replica all-reduce's
    ops."""

    scatter_op: Op = "sum"
    all_reduce_op: Op = "sum"
    pre_divide: float | None = None
    post_divide: float | None = None
    premul_factor: float | None = None


def _power_of_two_factor(factor: float) -> int:
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return pre


def reduce_spec(
    dtype: torch.dtype,
    shard_size: int,
    replicate_size: int = 1,
    *,
    mean: bool = True,
    divide_factor: float | None = None,
    force_sum: bool = False,
    avg: bool = True,
) -> ReduceSpec:
    """The arithmetic of a reduction in ``dtype`` over ``shard_size`` x ``replicate_size``
    ranks ([Note: dividing a mean of gradients]). ``mean=False``: a plain sum. ``avg``: the
    backend of the tensors' device reduces with ``AVG`` (``avg_supported``)."""
    if not mean:
        return ReduceSpec()
    force_sum = force_sum or not avg  # a backend without AVG sums (FSDP2's rule for MTIA)
    overflow_risk = dtype not in (torch.float32, torch.bfloat16)
    size = shard_size * replicate_size
    if not overflow_risk and not force_sum:
        if divide_factor is None:
            return ReduceSpec("avg", "avg") if size > 1 else ReduceSpec()
        if divide_factor == shard_size and shard_size > 1:
            return ReduceSpec("avg", "sum")
        return ReduceSpec(premul_factor=float(divide_factor))
    factor = float(size) if divide_factor is None else float(divide_factor)
    pre = _power_of_two_factor(factor) if overflow_risk else 1
    return ReduceSpec(
        pre_divide=float(pre) if pre != 1 else None,
        post_divide=factor / pre if factor / pre != 1 else None,
    )
