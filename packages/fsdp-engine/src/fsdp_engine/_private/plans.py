"""A group's plan: 16-byte aligned in every dtype the group uses, planned once per signature.

[Note: alignment in every dtype]
A group's flat buffer is viewed in several dtypes: the parameters' (the sharded storage), the
all-gather's and compute's (``param_dtype``: the unsharded storage), the reduction's
(``reduce_dtype``). Tensor ``i`` starts at element ``offsets[i]`` in each of them, i.e. at byte
``offsets[i] * itemsize``. Asking for every offset (and the shard size, hence every rank's
shard start) to be a multiple of ``lcm(16 / itemsize)`` over those dtypes makes every view of
every tensor 16-byte aligned in all of them: what GPU GEMMs and multi-tensor kernels want and
compilers guard on, and NCCL's preferred per-rank size. On the model catalogue this costs at
most 0.1 percentage point of padding (shard-planner's ``test_planner_align``).

[Note: plans cached by group signature]
A plan depends only on the group's (numel, block) list, the world size, the alignment and the
method; shapes matter only through numels, dtypes only through the alignment. Identical layers
(every decoder layer of a model) have one signature, so ``fully_shard`` on each of them plans
once, and the others reuse the plan with their own parameter names. Planning is deterministic,
so every rank's cache holds the same plans.
"""

from __future__ import annotations

import math
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch

from fsdp_engine._private.storage import storage_dtype
from shard_planner import Plan, TensorSpec, plan

__all__ = [
    "alignment",
    "build_plan",
    "cached_plan",
    "clear_plan_cache",
    "plan_cache_info",
    "view_dtypes",
]

_CACHE_SIZE = 512
_Key = tuple[tuple[tuple[int, int], ...], int, int, str]
_CACHE: OrderedDict[_Key, Plan] = OrderedDict()
_LOCK = threading.Lock()
_STATS = {"hits": 0, "misses": 0}


def alignment(dtypes: Sequence[torch.dtype]) -> int:
    """Elements per 16 bytes in every one of ``dtypes``: ``lcm(16 / itemsize)`` (at least 1)."""
    sizes = {torch.empty((), dtype=d).element_size() for d in dtypes}
    return math.lcm(1, *(max(1, 16 // size) for size in sizes))


def cached_plan(
    specs: Sequence[TensorSpec], world: int, dtypes: Sequence[torch.dtype], *, method: str
) -> Plan:
    """The plan of ``specs`` over ``world`` ranks, every shard size and tensor offset aligned to
    16 bytes in each of ``dtypes``; from the cache when a group of the same signature was
    planned before (module Note), named after ``specs`` either way."""
    align = alignment(dtypes)
    key: _Key = (tuple((s.numel, s.block) for s in specs), world, align, method)
    with _LOCK:
        found = _CACHE.get(key)
        if found is not None:
            _CACHE.move_to_end(key)
            _STATS["hits"] += 1
    if found is None:
        found = plan(specs, world, align, method=method, offset_align=align)
        with _LOCK:
            _STATS["misses"] += 1
            _CACHE[key] = found
            while len(_CACHE) > _CACHE_SIZE:
                _CACHE.popitem(last=False)
    names = tuple(s.name for s in specs)
    return found if found.names == names else attrs.evolve(found, names=names)


def plan_cache_info() -> dict[str, int]:
    """Hits, misses and entries of the plan cache (for tests and curious users)."""
    with _LOCK:
        return {**_STATS, "size": len(_CACHE)}


def clear_plan_cache() -> None:
    with _LOCK:
        _CACHE.clear()
        _STATS.update(hits=0, misses=0)


def view_dtypes(
    dtype: torch.dtype, param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None
) -> tuple[torch.dtype, ...]:
    """Every dtype a group of ``dtype`` views its buffers in: the parameters', their storage's
    (``storage`` [Note: bit-cast storage]), and the mixed-precision policy's compute and reduce
    dtypes ([Note: alignment in every dtype]). A later ``.to(dtype)`` keeps the plan."""
    dtypes = [dtype, storage_dtype(dtype)]
    if dtype.is_floating_point:
        dtypes += [d for d in (param_dtype, reduce_dtype) if d is not None]
    return tuple(dtypes)


def build_plan(
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    world: int,
    block_policy: Callable[[str, torch.Tensor], Any] | None,
    dtypes: Sequence[torch.dtype],
    method: str = "auto",
) -> Plan:
    """The group's plan: blocks from ``block_policy``, 16-byte aligned in every one of
    ``dtypes`` (``plans`` [Note: alignment in every dtype]), cached by signature."""
    specs = []
    for name, param in zip(names, params, strict=True):
        block = 1
        if block_policy is not None:
            try:
                value = block_policy(name, param)
            except Exception as exc:
                where = (
                    f"block policy {block_policy!r} failed for parameter {name!r} "
                    f"(shape {tuple(param.shape)})"
                )
                try:
                    renamed = type(exc)(f"{where}: {exc}")
                except Exception:  # an exception type that needs other arguments
                    exc.add_note(where)
                    raise exc from None
                raise renamed from exc
            try:
                block = operator.index(value)
            except TypeError:
                raise TypeError(
                    f"block policy gave parameter {name!r} the block {value!r} "
                    f"({type(value).__name__}); it must return an int number of "
                    f"elements"
                ) from None
        if block < 1 or param.numel() % block:
            raise ValueError(
                f"block policy gave parameter {name!r} (shape "
                f"{tuple(param.shape)}, {param.numel()} elements) a block of {block} "
                f"elements: it must be >= 1 and divide the parameter's numel"
            )
        specs.append(TensorSpec(numel=param.numel(), block=block, name=name))
    return cached_plan(specs, world, dtypes, method=method)
