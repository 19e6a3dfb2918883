"""Meta init allocates nothing: ``fully_shard`` of a meta model touches no memory (its buffers
stay on ``meta`` until ``to_empty``), ``to_empty`` reserves without writing, and a model far
larger than the host is sharded on meta without being killed. (``reset_parameters()`` after
``to_empty`` drawing one device's values: ``test_engine_random_init.py``.)"""

from __future__ import annotations

import resource

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_processes

_MIB = 1024  # ru_maxrss is in KiB on Linux


def _peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _rss_growth(rank: int, world: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.Linear(16000, 16000, bias=False)  # 977 MiB of fp32; 488 MiB a rank
        warm = nn.Linear(64, 64)
    fully_shard(warm, mesh=mesh)  # first-call costs (imports, the planner) out of the way
    before = _peak_kib()
    fully_shard(model, mesh=mesh)
    after_shard = _peak_kib()
    model.to_empty(device="cpu")
    after_empty = _peak_kib()
    weight = model.weight
    return {
        "fully_shard MiB": (after_shard - before) / _MIB,
        "to_empty MiB": (after_empty - after_shard) / _MIB,
        "local numel": float(weight.to_local().numel()),
        "meta after": float(weight.to_local().is_meta),
    }


def test_fully_shard_of_a_meta_model_touches_no_memory_and_to_empty_reserves() -> None:
    """Issue 25: ``fully_shard`` of a meta ``Linear(16000, 16000)`` grew each rank's peak RSS
    by ~525 MiB (the whole local shard zeroed, then freed). Now at most 64 MiB in
    ``fully_shard``, and ``to_empty`` reserves the 488 MiB share without writing it."""
    for result in run_processes(_rss_growth, 2, timeout=180):
        assert result["fully_shard MiB"] <= 64, result
        assert result["to_empty MiB"] <= 64, result
        assert result["local numel"] == 16000 * 16000 / 2 and not result["meta after"], result


def _huge(rank: int, world: int) -> dict[str, float]:
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.Linear(112000, 112000, bias=False)  # 47 GiB of fp32; 23 GiB a rank
    before = _peak_kib()
    fully_shard(model, mesh=mesh)
    local = model.weight.to_local()
    return {
        "MiB": (_peak_kib() - before) / _MIB,
        "meta": float(local.is_meta),
        "numel": float(local.numel()),
    }


def test_a_model_larger_than_the_host_is_sharded_on_meta() -> None:
    """Issue 25: a model whose shard exceeds host memory was killed by the kernel inside
    ``fully_shard``, with no message; FSDP2 returns at once. So do we now."""
    for result in run_processes(_huge, 2, timeout=180):
        assert result["meta"] == 1.0 and result["numel"] == 112000 * 112000 / 2, result
        assert result["MiB"] <= 64, result
