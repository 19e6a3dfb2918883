"""No host synchronization in a recurring step: every optimizer's steady-state step (after the
first step made its plan) reads nothing from the device and copies nothing from the host.

Counted with ``optim_support.HostReads`` on the CPU threaded process group: reads of device
values (``_local_scalar_dense``: ``item``, ``bool``, ``float``; ``tolist``; data-dependent
shapes) and tensors made from host data (``lift_fresh``: on an accelerator, a pageable
host-to-device copy). Each would stall the host on CUDA. Steps 3-5 must have none, and only
the collectives the step's data needs (no agreement all-gather once the layout is agreed).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from optim_support import UNALIGNED, HostReads, ragged_spec, shard
from torch.distributed.device_mesh import init_device_mesh

import optim_blockwise as ob
from ragged_dtensor.testing import count_collectives, run_threaded

pytestmark = pytest.mark.filterwarnings(UNALIGNED)

WARMUP, STEPS = 2, 3


def _make(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "muon":
        return ob.Muon(params, ns_dtype=torch.float32, bucket_cap_mb=0.01)
    if kind.startswith("adamw8bit"):
        return ob.AdamW8bit(params, min_8bit_size=0, block_size=16)
    if kind == "shampoo":  # a root refresh in every step
        return ob.Shampoo(
            params,
            max_preconditioner_dim=16,
            precondition_frequency=1,
            start_preconditioning_step=1,
        )
    if kind == "soap":  # an eigenbasis refresh in every step
        return ob.SOAP(params, max_preconditioner_dim=16, precondition_frequency=1)
    raise ValueError(kind)


def _steady_state(rank: int, world: int, kind: str, absent: tuple[int, ...]) -> dict[str, Any]:
    """Steps ``WARMUP + 1 ..`` of ``kind`` on RaggedShard params: per step, the host reads and
    the collectives. Parameters ``absent`` have no gradient on any rank in any step."""
    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (40, 50), (4, 12, 20), (33,) if kind == "muon" else (48,), (16,), (24, 24)]
    # block-aligned shards (AdamW8bit's block policy) or shards that cut blocks and tiles
    unit = 16 if kind == "adamw8bit" else 1
    specs = [ragged_spec(s, world, unit, seed=i) for i, s in enumerate(shapes)]
    params = [
        torch.nn.Parameter(shard(torch.randn(s, generator=gen), mesh, sp))
        for s, sp in zip(shapes, specs, strict=True)
    ]
    opt = _make(kind, params)
    reads: list[list[str]] = []
    collectives: list[list[str]] = []
    for step in range(WARMUP + STEPS):
        for i, (p, s, sp) in enumerate(zip(params, shapes, specs, strict=True)):
            p.grad = None if i in absent else shard(torch.randn(s, generator=gen), mesh, sp)
        if step < WARMUP:
            opt.step()
            continue
        with HostReads() as found, count_collectives() as counted:
            opt.step()
        reads.append(found)
        collectives.append(list(counted.calls))
    return {"reads": reads, "collectives": collectives}


CASES = {
    # kind, parameters without gradients, the collectives a steady-state step may issue
    "muon": ("muon", (), {"all_to_all_single"}),
    # some units of a bucket present, others not: the presence flags are mixed
    "muon-mixed-presence": ("muon", (1, 5), {"all_to_all_single"}),
    "adamw8bit-aligned": ("adamw8bit", (), set()),
    # shards cut quantization blocks: the edge absmaxes travel, no agreement all-gather
    "adamw8bit-cut": ("adamw8bit-cut", (), {"all_gather"}),
    "adamw8bit-cut-mixed-presence": ("adamw8bit-cut", (0, 5), {"all_gather"}),
    # a root / eigenbasis refresh in every step, on local and exchanged tiles
    "shampoo": ("shampoo", (), {"all_to_all_single"}),
    "soap": ("soap", (), {"all_to_all_single"}),
    "shampoo-mixed-presence": ("shampoo", (1,), {"all_to_all_single"}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_steady_state_step_reads_nothing_from_the_device(case: str) -> None:
    kind, absent, allowed = CASES[case]
    for rank, out in enumerate(run_threaded(_steady_state, 3, kind, absent, timeout=120)):
        assert out["reads"] == [[]] * STEPS, (rank, out["reads"])
        calls = {c for step in out["collectives"] for c in step}
        assert calls == allowed, (rank, out["collectives"])


# [Note: eigh, the one sync the maths needs]
# ``torch.linalg.eigh`` checks its LAPACK/cuSOLVER status on the host (``_linalg_check_errors``):
# on CUDA every call waits for the device. Shampoo needs it for its inverse roots and SOAP for
# its first eigenbasis, so it may run only when a preconditioner is refreshed: once per tile
# and side in a refresh step, never in the steps between. On CPU the wait is invisible, so the
# eigh calls are counted at the dispatcher (``_linalg_eigh``) like the host reads above.

_EIGH_OPS = {"_linalg_eigh", "linalg_eigh", "_linalg_eigvals", "linalg_eig"}
REFRESH_EVERY = 3  # Shampoo: refreshes at steps 1, 4, 7; SOAP: eigh at step 1, QR after


def _eigh_per_step(rank: int, world: int, kind: str) -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    shapes = [(64, 96), (40, 50), (24, 24), (16,)]
    specs = [ragged_spec(s, world, 1, seed=i) for i, s in enumerate(shapes)]
    params = [
        torch.nn.Parameter(shard(torch.randn(s, generator=gen), mesh, sp))
        for s, sp in zip(shapes, specs, strict=True)
    ]
    opt: ob.Shampoo | ob.SOAP
    if kind == "shampoo":
        opt = ob.Shampoo(
            params,
            max_preconditioner_dim=16,
            precondition_frequency=REFRESH_EVERY,
            start_preconditioning_step=1,
        )
    else:
        opt = ob.SOAP(params, max_preconditioner_dim=16, precondition_frequency=REFRESH_EVERY)
    calls: list[str] = []

    class CountEigh(TorchDispatchMode):
        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            if func.__name__.split(".")[0] in _EIGH_OPS:
                calls.append(func.__name__)
            return func(*args, **(kwargs or {}))

    per_step: list[tuple[int, int, list[str]]] = []
    for _ in range(7):
        for p, s, sp in zip(params, shapes, specs, strict=True):
            p.grad = shard(torch.randn(s, generator=gen), mesh, sp)
        calls.clear()
        with CountEigh(), HostReads() as found:
            opt.step()
        stats = opt._stats  # tiles this rank computed (no device read, unlike last_step_stats)
        tiles = stats["local_tiles"] + stats["exchanged_tiles"]
        per_step.append((len(calls), tiles, list(found)))
    return {"per_step": per_step}


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_eigh_runs_only_in_refresh_steps_once_per_tile_and_side(kind: str) -> None:
    for rank, out in enumerate(run_threaded(_eigh_per_step, 3, kind, timeout=120)):
        for step, (eighs, tiles, reads) in enumerate(out["per_step"], start=1):
            refresh = (step - 1) % REFRESH_EVERY == 0 if kind == "shampoo" else step == 1
            expected = 2 * tiles if refresh else 0  # left and right, per tile this rank owns
            assert eighs == expected, (rank, step, eighs, tiles)
            if step > 1:  # the plan (step 1) may read; no step after it reads anything
                assert reads == [], (rank, step, reads)
