"""The mesh advisor's advice, applied as is to ``fully_shard`` on the demo model.

``shard_planner.projection.advise`` chooses an HSDP mesh ``(replicate, shard)`` and which modules
share a ``fully_shard`` group; the engine takes both directly: ``init_device_mesh(..., mesh_shape)``
and one ``fully_shard`` call per advised group (a list of modules where the advice groups several).
The engine's plans must be the advisor's (same shard sizes and padding, since both run the planner
on the same tensors and blocks), and the model must train on that mesh: 8 ranks of the threaded
process group, one step, finite loss, gradients in every group.
"""

from __future__ import annotations

import math
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import fully_shard
from ragged_dtensor.testing import run_threaded
from shard_planner.projection import GPUS, Group, LayerShape, Model, Setup, Weight, advise

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from llama import PRESETS, Llama, loss_fn

WORLD = 8
ROWS = 16  # 16-row blocks, e.g. for blockwise 8-bit optimizer states
CFG = PRESETS["small"].with_vocab(103)
_LOCK = threading.RLock()


def _weights(modules: list[nn.Module]) -> tuple[Weight, ...]:
    return tuple(
        Weight(name, tuple(p.shape), matrix=p.dim() >= 2)
        for m in modules
        for name, p in m.named_parameters()
    )


def demo_model() -> tuple[Model, Llama]:
    """The demo model described for the planner: its groups, shapes and layer widths."""
    with _LOCK, torch.random.fork_rng():
        torch.manual_seed(0)
        net = Llama(CFG)
    d = CFG.dim
    layer = LayerShape("dense", d, heads=CFG.heads, q_dim=d, kv_dim=d, v_dim=d, ffn=CFG.ffn)
    groups = (
        Group("embed", _weights([net.embed]), layer=LayerShape("embed", d, vocab=CFG.vocab)),
        Group("layer", _weights([net.layers[0]]), count=CFG.layers, layer=layer),
        Group("head", _weights([net.norm, net.head]), layer=LayerShape("head", d, vocab=CFG.vocab)),
    )
    return Model("demo-small", groups), net


def block_policy(name: str, param: torch.Tensor) -> int:
    """The catalogue's block rule (``Weight.block``): ``gcd(16, rows)`` rows of a matrix."""
    if param.dim() < 2:
        return 1
    return math.gcd(ROWS, param.shape[-2]) * param.shape[-1]


def _advice() -> Any:
    model, _ = demo_model()
    setup = Setup(seq=CFG.seq, micro_batch=2, block_rows=ROWS)
    # A tight padding limit and shard groups of 2 to 8 ranks: a layer alone pads too much at
    # the larger groups, so the advice must pick the mesh and the grouping together.
    return advise(model, WORLD, GPUS["H100"], setup, max_padding=0.001, shard_choices=[2, 4, 8])


def _train(rank: int, world: int, advice: Any) -> dict[str, Any]:
    _, net = demo_model()
    mesh = init_device_mesh("cpu", advice.mesh_shape, mesh_dim_names=advice.mesh_dim_names)
    units = []
    for names in advice.module_groups(CFG.layers):
        modules: list[nn.Module] = []
        for name in names:
            if name == "embed":
                modules.append(net.embed)
            elif name == "head":
                modules += [net.norm, net.head]
            else:
                modules.append(net.layers[int(name)])
        target: Any = modules if len(modules) > 1 else modules[0]
        unit = fully_shard(target, mesh=mesh, block_policy=block_policy)
        units.append(unit[0] if isinstance(unit, list) else unit)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, CFG.vocab, (2, CFG.seq + 1), generator=gen)
    loss = loss_fn(net, tokens)
    loss.backward()
    with_grad = [all(p.grad is not None for p in u.parameters()) for u in units]
    opt.step()
    plans = [u.shard_plan() for u in units]
    return {
        "loss": loss.item(),
        "with_grad": with_grad,
        "shards": [p.shard_size for p in plans],
        "padding": [p.padding for p in plans],
    }


def test_engine_takes_the_advice_directly() -> None:
    advice = _advice()
    assert advice.chosen is not None, advice.explain()
    replicas, shard = advice.mesh_shape
    assert replicas * shard == WORLD
    # the advice is HSDP with several layers per group (what the constraints force)
    assert replicas > 1 and advice.chosen.layers_per_group > 1, advice.explain()
    projected = advice.projection.ours
    expected_shards = [g.shard for g in projected.groups for _ in range(g.count)]
    expected_padding = [g.padding for g in projected.groups for _ in range(g.count)]
    results = run_threaded(_train, WORLD, advice, timeout=120)
    for r in results:
        assert math.isfinite(r["loss"])
        assert all(r["with_grad"])
        assert r["shards"] == expected_shards
        assert r["padding"] == expected_padding
    # the advised grouping is within the padding limit the engine now runs with
    numel = sum(p.numel() for p in demo_model()[1].parameters())
    assert sum(results[0]["padding"]) <= advice.max_padding * numel
