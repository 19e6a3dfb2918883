"""The issue order of collectives relative to compute, for ours and torch's FSDP2 (test helper).

A 4-layer model whose layers have different sizes, so each collective is named after the group
it moves by its per-rank size: ``AG:L2`` (an all-gather of layer 2), ``RS:root``, and ``F:L1`` /
``B:L1`` when layer 1's forward / backward compute starts (hooks on its first Linear; they run
after the engine's own pre-forward / pre-backward of the layer). Collectives are logged per
thread (threaded process group: the ranks are threads) through ``torch.distributed.<name>``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

DIMS = (8, 12, 16, 20, 24)  # layer k: Linear(DIMS[k], DIMS[k+1]) + ReLU
_LOCAL = threading.local()
_NAMES = {
    "all_gather_single": "AG",
    "all_gather_into_tensor": "AG",
    "reduce_scatter_single": "RS",
    "reduce_scatter_tensor": "RS",
    "all_reduce": "AR",
}
_INSTALLED = False
_LOCK = threading.Lock()


def _log() -> list[tuple[str, int, bool]] | None:
    return getattr(_LOCAL, "log", None)


def _wrap(short: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def traced(*args: Any, **kwargs: Any) -> Any:
        log = _log()
        if log is not None:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            log.append((short, min(t.numel() for t in tensors), bool(kwargs.get("async_op"))))
        return fn(*args, **kwargs)

    return traced


def install() -> None:
    """Wrap the collectives once for the whole process (each thread logs to its own list)."""
    global _INSTALLED
    with _LOCK:
        if _INSTALLED:
            return
        for name, short in _NAMES.items():
            setattr(dist, name, _wrap(short, getattr(dist, name)))
        _INSTALLED = True


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU()) for a, b in itertools.pairwise(DIMS)
        )
        self.head = nn.Linear(DIMS[-1], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _group_size(engine: str, module: nn.Module) -> int:
    """The per-rank numel a group's collectives move (ours: the plan's shard size)."""
    if engine == "ours":
        return int(module.shard_plan().shard_size)  # type: ignore[operator]
    group = module._get_fsdp_state()._fsdp_param_group  # type: ignore[operator]
    return sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)


def _per_rank_sizes(engine: str, model: Net, world: int) -> dict[int, str]:
    """The per-rank numel each group's collectives move -> the group's name."""
    sizes: dict[int, str] = {}
    modules: list[tuple[str, nn.Module]] = [(f"L{k}", m) for k, m in enumerate(model.layers)]
    modules.append(("root", model))
    for name, module in modules:
        size = _group_size(engine, module)
        assert size not in sizes, f"two groups move {size} elements per rank"
        sizes[size] = name
    return sizes


def trace(
    engine: str,
    rank: int,
    world: int,
    iterations: int = 2,
    reshard_after_forward: bool | int = True,
    mark_async: bool = False,
) -> list[list[str]]:
    """Each iteration's events (forward + backward), for ``engine`` in this rank's thread;
    ``mark_async`` appends ``~`` to collectives issued with ``async_op=True``."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_engine

    install()
    api: Any = fsdp_engine if engine == "ours" else torch_fsdp
    mesh = init_device_mesh("cpu", (world,))
    with _LOCK:  # the ranks are threads sharing torch's generator: the same weights on each
        torch.manual_seed(0)
        model = Net()
    for layer in model.layers:
        api.fully_shard(layer, mesh=mesh, reshard_after_forward=reshard_after_forward)
    api.fully_shard(model, mesh=mesh)
    sizes = _per_rank_sizes(engine, model, world)
    if not isinstance(reshard_after_forward, bool):  # the sub-group regathers move m*S/k
        k = reshard_after_forward
        for size, name in list(sizes.items()):
            if name != "root":
                sizes[size * world // k] = f"{name}/{k}"
    events: list[tuple[str, int, bool] | str] = []
    for k, layer in enumerate(model.layers):
        first = layer[0]
        first.register_forward_pre_hook(lambda m, a, k=k: events.append(f"F:L{k}"))
        first.register_full_backward_pre_hook(lambda m, g, k=k: events.append(f"B:L{k}"))
    x = torch.randn(3, DIMS[0], generator=torch.Generator().manual_seed(rank))
    out: list[list[str]] = []
    _LOCAL.log = events
    try:
        for _ in range(iterations):
            events.clear()
            model(x).sum().backward()
            named = []
            for event in events:
                if isinstance(event, tuple):
                    kind, numel, is_async = event
                    mark = "~" if mark_async and is_async else ""
                    named.append(f"{kind}:{sizes.get(numel, numel)}{mark}")
                else:
                    named.append(event)
            out.append(named)
    finally:
        _LOCAL.log = None
    return out


class CheckpointedNet(Net):
    """``Net`` with a second Linear per layer, each layer checkpoint-wrapped (activation
    checkpointing); the trace shards that inner Linear on its own inside the wrapped layer, as
    MoE code shards its experts inside a checkpointed block."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, b))
            for a, b in itertools.pairwise(DIMS)
        )


def trace_checkpointed_backward(engine: str, rank: int, world: int) -> list[str]:
    """The collectives of the second iteration's backward (after ``loss.backward()`` is
    called) for ``CheckpointedNet``: each layer checkpoint-wrapped, its inner Linear a
    fully_shard group of its own (``Lk.in``) inside it, and explicit backward prefetching of
    the previous layer and its inner group (``set_modules_to_backward_prefetch``)."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_engine

    install()
    api: Any = fsdp_engine if engine == "ours" else torch_fsdp
    mesh = init_device_mesh("cpu", (world,))
    with _LOCK:
        torch.manual_seed(0)
        model = CheckpointedNet()
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Sequential))
    names: dict[int, str] = {}
    inners = []
    for k, layer in enumerate(model.layers):
        inner = layer._checkpoint_wrapped_module[2]
        api.fully_shard(inner, mesh=mesh)
        api.fully_shard(layer, mesh=mesh)
        inners.append(inner)
        names[_group_size(engine, inner)] = f"L{k}.in"
        names[_group_size(engine, layer)] = f"L{k}"
    api.fully_shard(model, mesh=mesh)
    names[_group_size(engine, model)] = "root"
    assert len(names) == 2 * len(model.layers) + 1, "two groups move the same size"
    for k in range(1, len(model.layers)):
        model.layers[k].set_modules_to_backward_prefetch([model.layers[k - 1], inners[k - 1]])
    x = torch.randn(3, DIMS[0], generator=torch.Generator().manual_seed(rank))
    events: list[tuple[str, int, bool]] = []
    _LOCAL.log = events
    try:
        for _ in range(2):
            loss = model(x).sum()
            events.clear()
            loss.backward()
    finally:
        _LOCAL.log = None
    return [f"{kind}:{names.get(numel, numel)}" for kind, numel, _ in events]
