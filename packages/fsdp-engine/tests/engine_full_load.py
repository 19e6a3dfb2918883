"""Per-rank bodies of the full-state-dict load tests (``test_engine_full_state_dict_load.py``):
one process's trained model and AdamW state as full tensors, loaded with torch's
``set_*_state_dict(..., StateDictOptions(full_state_dict=True, ...))`` into a sharded model, by
fsdp_engine and by torch's FSDP2 (the control) with the same calls.

What a body returns: the loaded state read back as full tensors (model and optimizer), the full
model state after one more training step, and per load call the live-tensor peak and what was
still alive at its end (``dbuffer.testing.LiveBytes``: every storage an op creates on this
rank's thread, including the broadcast's receive buffers and the shares; the source state dict,
made before, is not counted). Peak minus what is left is the call's transient overhead.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from engine_fsdp2 import Stack, data, engine, make, shard_stack
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import init_device_mesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dbuffer.testing import LiveBytes

DIM = 16
LR = 1e-2


def _stack() -> Stack:
    return Stack(n=2, dim=DIM)


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> float:
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def source_state(factory: Any = _stack) -> tuple[dict[str, Any], dict[str, Any]]:
    """One process's model after two AdamW steps, and its optimizer state, as full state dicts
    (FQN keys), the form a pretrained or a ``FULL_STATE_DICT`` checkpoint has."""
    model = make(factory, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(2):
        _train_step(model, opt, data(0, step, dim=DIM))
    full = StateDictOptions(full_state_dict=True)
    msd, osd = get_state_dict(model, opt, options=full)
    return {k: v.detach().clone() for k, v in msd.items()}, copy.deepcopy(osd)


def _flat(osd: dict[str, Any]) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, state in osd["state"].items():
        for name, value in state.items():
            out[f"{fqn}.{name}"] = value.detach().clone()
    return out


def _load(
    model: nn.Module,
    msd: dict[str, Any],
    osd: dict[str, Any],
    options: StateDictOptions,
    *,
    optimizer_first: bool,
) -> tuple[torch.optim.Optimizer, dict[str, tuple[int, int]]]:
    """Load model and optimizer state; per call, the live-bytes peak and what the call left
    alive at its end (new storages still held: the loaded shares, torch's dicts).

    ``optimizer_first`` (parameters exist): the AdamW is made first, and without
    ``broadcast_from_rank0`` both are loaded by one ``set_state_dict``. Otherwise
    ``set_model_state_dict``, then (meta parameters are replaced by the load) the AdamW is made
    over the loaded parameters and ``set_optimizer_state_dict`` loads its state.
    ``set_state_dict`` is not used with ``broadcast_from_rank0``: torch 2.13 skips the model on
    ranks given an empty model dict (``optim_only=not model_state_dict``) while rank 0
    broadcasts it, a hang on FSDP2 as on ours."""
    peaks = {}
    if optimizer_first and not options.broadcast_from_rank0:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        with LiveBytes() as live:
            set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
        peaks["model+optimizer"] = (int(live.peak), int(live.current))
        return opt, peaks
    opt = torch.optim.AdamW(model.parameters(), lr=LR) if optimizer_first else None
    with LiveBytes() as live:
        set_model_state_dict(model, msd, options=options)
    peaks["model"] = (int(live.peak), int(live.current))
    if opt is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
    with LiveBytes() as live:
        set_optimizer_state_dict(model, opt, osd, options=options)
    peaks["optimizer"] = (int(live.peak), int(live.current))
    return opt, peaks


def _local_bytes(tensors: Any) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def resident(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes of this rank's shares after the load: what any load must hold at its end."""
    states = [v for s in opt.state.values() for v in s.values()]
    return {"params": _local_bytes(model.parameters()), "optimizer": _local_bytes(states)}


def _mesh(layout: str, world: int) -> Any:
    if layout == "fsdp":
        return init_device_mesh("cpu", (world,))
    if layout == "hsdp":
        return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    raise ValueError(f"layout must be 'fsdp' or 'hsdp', got {layout!r}")


def load_case(
    rank: int,
    world: int,
    engine_name: str,
    layout: str,
    init: str,
    broadcast: bool,
    cpu_offload: bool,
) -> dict[str, Any]:
    """A ``Stack`` built on the meta device and sharded, loaded into the meta parameters
    (``init="meta"``) or after ``to_empty`` (``init="to_empty"``), by ``_load``. With
    ``broadcast``, only rank 0 passes the full state (the others pass empty dicts)."""
    api = engine(engine_name)
    msd_full, osd_full = source_state()
    options = StateDictOptions(
        full_state_dict=True, broadcast_from_rank0=broadcast, cpu_offload=cpu_offload
    )
    given = rank == 0 or not broadcast
    # torch replaces the values of the dicts it is given: each call gets its own copies
    msd = {k: v.clone() for k, v in msd_full.items()} if given else {}
    osd = copy.deepcopy(osd_full) if given else {}
    with torch.device("meta"):
        model = _stack()
    shard_stack(api, model, mesh=_mesh(layout, world))
    if init == "to_empty":
        model.to_empty(device="cpu")
    elif init != "meta":
        raise ValueError(f"init must be 'meta' or 'to_empty', got {init!r}")
    opt, peaks = _load(model, msd, osd, options, optimizer_first=init == "to_empty")
    read = StateDictOptions(full_state_dict=True)
    loaded_model = {k: v.clone() for k, v in get_model_state_dict(model, options=read).items()}
    loaded_optim = _flat(get_optimizer_state_dict(model, opt, options=read))
    held = resident(model, opt)
    loss = _train_step(model, opt, data(rank, 5, dim=DIM))
    stepped = {k: v.clone() for k, v in get_model_state_dict(model, options=read).items()}
    return {
        "source_model": msd_full,
        "source_optim": _flat(osd_full),
        "loaded_model": loaded_model,
        "loaded_optim": loaded_optim,
        "loss": loss,
        "stepped": stepped,
        "peaks": peaks,
        "resident": held,
    }


# -- FSDP + TP on a 2-D mesh ----------------------------------------------------------------------


class TPNet(nn.Module):
    """A column-wise then a row-wise parallel linear (tensor parallelism on "tp")."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 20)
        self.down = nn.Linear(20, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(F.gelu(self.up(x)))
        return out


def tp_case(rank: int, world: int, engine_name: str, broadcast: bool) -> dict[str, Any]:
    """``TPNet`` on a (dp=2, tp=2) mesh: ``parallelize_module`` on "tp", ``fully_shard`` on
    "dp"; an AdamW; model and optimizer state loaded with ``full_state_dict=True`` (and
    ``broadcast_from_rank0``) by ``_load``."""
    api = engine(engine_name)
    msd_full, osd_full = source_state(TPNet)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = make(TPNet, seed=7)  # other values than the source's: the load must replace them
    parallelize_module(model, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    api.fully_shard(model, mesh=mesh["dp"])
    given = rank == 0 or not broadcast
    msd = {k: v.clone() for k, v in msd_full.items()} if given else {}
    osd = copy.deepcopy(osd_full) if given else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast)
    opt, peaks = _load(model, msd, osd, options, optimizer_first=True)
    read = StateDictOptions(full_state_dict=True)
    loaded_model = {k: v.clone() for k, v in get_model_state_dict(model, options=read).items()}
    loaded_optim = _flat(get_optimizer_state_dict(model, opt, options=read))
    dp = mesh.get_local_rank("dp")
    held = resident(model, opt)
    loss = _train_step(model, opt, data(dp, 5, dim=DIM))
    stepped = {k: v.clone() for k, v in get_model_state_dict(model, options=read).items()}
    return {
        "source_model": msd_full,
        "source_optim": _flat(osd_full),
        "loaded_model": loaded_model,
        "loaded_optim": loaded_optim,
        "loss": loss,
        "stepped": stepped,
        "peaks": peaks,
        "resident": held,
    }


def run_cases(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case (``body``: ``"load"`` or ``"tp"``, and that body's arguments) in order, in one
    launch of the processes."""
    bodies = {"load": load_case, "tp": tp_case}
    results = []
    for case in cases:
        options = {k: v for k, v in case.items() if k != "body"}
        results.append(bodies[case["body"]](rank, world, **options))
    return results
