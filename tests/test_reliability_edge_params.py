"""Zero-element and 0-d parameters on ``fully_shard`` survive save / load with every optimizer
(torch AdamW, optim_blockwise AdamW8bit and Muon, fsdp_engine's FlatShardOptimizer), bit for bit.

Regressions (found by the adversarial runs of issue 14): a zero-element parameter was missing
from our checkpoints ("Missing key in checkpoint state_dict: model.empty"; FSDP2 and plain DCP
keep it): its ragged share was split into zero boxes, so no rank wrote anything for the key. A
0-d parameter with Muon or AdamW8bit failed in ``get_state_dict`` ("placement type RaggedShard
not supported!"): torch's ``DTensor.from_local`` takes ``shape=torch.Size([])`` for "not given".
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, init_device_mesh

import optim_blockwise as ob
from fsdp_engine import FlatShardOptimizer, fully_shard, load_checkpoint, save_checkpoint
from ragged_dtensor import RaggedShard
from ragged_dtensor.testing import run_threaded

OPTIMIZERS = ("adamw", "adamw8bit", "muon", "flat")


class Edge(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.empty = nn.Parameter(torch.empty(0, 8))  # zero-element matrix
        self.empty_vec = nn.Parameter(torch.empty(0))  # zero-element vector
        self.scale = nn.Parameter(torch.tensor(1.5))  # 0-d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self.scale
        return y + self.empty.sum() + self.empty_vec.sum()


def _build(world: int, kind: str) -> tuple[nn.Module, Any]:
    gen = torch.Generator().manual_seed(0)
    model = Edge()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    opt: Any
    if kind == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif kind == "adamw8bit":
        opt = ob.AdamW8bit(model.parameters(), lr=1e-2)
    elif kind == "muon":
        opt = ob.Muon(model.parameters(), lr=1e-2, ns_dtype=torch.float32)
    else:
        opt = FlatShardOptimizer(model, torch.optim.AdamW, lr=1e-2)
    return model, opt


def _flat_state(opt: FlatShardOptimizer, model: nn.Module) -> dict[str, Any]:
    """FlatShardOptimizer's state is per-rank flat memory (plain tensors, which DCP would
    deduplicate): each flat state tensor is wrapped as a RaggedShard DTensor over its group's
    flat buffer (every rank holds one equal shard)."""
    state = opt.state_dict()
    mesh = opt.groups[0].mesh
    world = mesh.size(0)
    wrapped: dict[Any, dict[str, Any]] = {}
    for pid, entry in state["state"].items():
        wrapped[pid] = {}
        for key, value in entry.items():
            flat = isinstance(value, torch.Tensor) and value.dim() == 1
            wrapped[pid][key] = (
                DTensor.from_local(
                    value,
                    mesh,
                    [RaggedShard((0,), (1,) * world)],
                    shape=torch.Size([world * value.numel()]),
                    run_check=False,
                )
                if flat
                else value
            )
    return {"model": model.state_dict(), "optim": {**state, "state": wrapped}}


def _state(model: nn.Module, opt: Any, kind: str) -> dict[str, Any]:
    if kind == "flat":
        return _flat_state(opt, model)
    model_sd, optim_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optim": optim_sd}


def _full(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}

    def visit(value: Any, prefix: str) -> None:
        if isinstance(value, DTensor):
            out[prefix] = value.full_tensor().detach().clone()
        elif isinstance(value, torch.Tensor):
            out[prefix] = value.detach().clone()
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{prefix}.{key}")

    visit(state, "")
    return out


def _round_trip(rank: int, world: int, root: str, kind: str, phase: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    model, opt = _build(world, kind)
    if phase == "save":
        gen = torch.Generator().manual_seed(1)
        for _ in range(2):
            x = torch.randn(4, 8, generator=gen)
            model(x[rank::world]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        state = _state(model, opt, kind)
        save_checkpoint(state, Path(root) / kind)
    else:
        if kind == "flat":  # torch's AdamW makes its state at the first step: make it now
            for flat in opt.flat:
                opt.state[flat].update(
                    step=torch.tensor(0.0),
                    exp_avg=torch.zeros_like(flat),
                    exp_avg_sq=torch.zeros_like(flat),
                )
        state = _state(model, opt, kind)
        load_checkpoint(state, Path(root) / kind)
        if kind == "flat":
            model.load_state_dict(state["model"])
            for pid, entry in state["optim"]["state"].items():
                for key, value in entry.items():
                    if isinstance(value, DTensor):
                        opt.state[opt.flat[pid]][key].copy_(value.to_local())
        else:
            set_state_dict(
                model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )
        state = _state(model, opt, kind)
    full = _full(state)
    return {"keys": sorted(full), "values": full}


@pytest.mark.parametrize("kind", OPTIMIZERS)
def test_zero_element_and_0d_parameters_round_trip(tmp_path: Path, kind: str) -> None:
    """Same world size (2), same arithmetic on both sides: the loaded state equals the saved
    state bit for bit (parameters, optimizer state)."""
    saved = run_threaded(_round_trip, 2, str(tmp_path), kind, "save", timeout=120)
    loaded = run_threaded(_round_trip, 2, str(tmp_path), kind, "load", timeout=120)
    want = saved[0]
    assert any(key.endswith("empty") for key in want["keys"]), want["keys"]
    assert any(key.endswith("scale") for key in want["keys"]), want["keys"]
    for got in loaded:
        assert got["keys"] == want["keys"]
        for key, value in want["values"].items():
            assert got["values"][key].shape == value.shape, key
            assert torch.equal(got["values"][key], value), key
