"""The all-gather extension's hooks and packing run on the all-gather stream, ordered, checked
on CPU with dbuffer's simulated streams (``dbuffer.testing``; the model is described there).

Two ranks (threaded process group, one simulation each) train a 3-layer model whose weights
define FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (the values travel in bf16
and are upcast after), for three steps with a foreach SGD step on the compute stream between
iterations, bf16 compute, implicit prefetching. Two kinds of subclass: one rebuilt over a view
of the group's storage, and one keeping its own storage (FSDP2's padded chunk). The model must
see no race and the hooks' work must run on the all-gather stream (as FSDP2's copy-in stream);
a planted race (the hooks no longer wait for the shards' last write: the optimizer's update
on the compute stream) must be reported.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.two_tensor import TwoTensor

import fsdp_engine
from dbuffer._private import streams as streams_module
from dbuffer.testing import install_simulated_streams, simulated_event_now, simulated_streams
from fsdp_engine._private import extension_gather as extension_module
from fsdp_engine._private import gather as gather_module
from ragged_dtensor.testing import run_threaded

_BUILD = threading.Lock()  # ranks are threads sharing torch's generator
_HOOK_STREAMS: dict[int, set[str]] = {}


def _values(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.a if isinstance(tensor, TwoTensor) else tensor._data  # type: ignore[attr-defined]


def _pre(
    self: torch.Tensor, mesh: Any, outer_size: Any, outer_stride: Any, module: Any, policy: Any
) -> tuple[tuple[torch.Tensor, ...], Any]:
    """The values in bf16, padded to the padded chunk (temporaries of the hook's)."""
    stream = streams_module.current_stream(self.device)
    _HOOK_STREAMS.setdefault(threading.get_ident(), set()).add(str(stream.name))
    values = _values(self)
    rows = -(-outer_size[0] // mesh.size())
    padded = torch.zeros((rows, *outer_size[1:]), dtype=torch.bfloat16)
    padded[: values.size(0)].copy_(values * 1.0)
    return (padded,), None


def _post(
    self: torch.Tensor, outputs: Any, metadata: Any, dtype: torch.dtype, *, out: Any = None
) -> Any:
    (gathered,) = outputs
    if out is not None:
        with torch.no_grad(), _unsafe_preserve_version_counter(out):
            out.copy_(gathered[: out.shape[0]])
        return None
    upcast = gathered.to(dtype)
    return upcast, (upcast,)


class _ViewWeight(torch.Tensor):
    """A wrapper of one tensor: rebuilt over a view of the group's storage."""

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> Any:
        out = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls,
            data.shape,
            data.stride(),
            data.storage_offset(),
            dtype=data.dtype,
            device=data.device,
        )
        out._data = data
        return out

    def __repr__(self) -> str:  # type: ignore[override]
        return f"_ViewWeight({self._data!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cls, out) if func in _KEEP else out

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner: Any, ctx: Any, size: Any, stride: Any) -> Any:
        return _ViewWeight(inner["_data"])

    fsdp_pre_all_gather = _pre
    fsdp_post_all_gather = _post


_KEEP = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.split.Tensor,
}


def _train(rank: int, world: int, kind: str) -> tuple[list[str], set[str], set[str]]:
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    with _BUILD:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    for block in model:
        w = block[0].weight.detach()
        value = _ViewWeight(w.clone()) if kind == "view" else TwoTensor(w.clone(), w.clone())
        block[0].weight = nn.Parameter(value)
    policy = fsdp_engine.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    _HOOK_STREAMS.pop(threading.get_ident(), None)
    with simulated_streams() as sim:
        for block in model:
            fsdp_engine.fully_shard(block, mesh=mesh, mp_policy=policy)
        fsdp_engine.fully_shard(model, mesh=mesh, mp_policy=policy)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
        for _ in range(3):
            model(x).float().sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        hooks = _HOOK_STREAMS.get(threading.get_ident(), set())
        return list(sim.races), set(sim.accessed), hooks


@contextlib.contextmanager
def _unordered(device: torch.device, ready: Any) -> Iterator[None]:
    """The planted race: the all-gather stream without the wait for ``ready``."""
    with streams_module.on_stream(streams_module.comm_stream_for(device, "all_gather")):
        yield


@pytest.mark.parametrize("kind", ["view", "own"])
@pytest.mark.parametrize("planted", [False, True])
def test_extension_hooks_run_on_the_all_gather_stream_without_race(
    kind: str, planted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    install_simulated_streams(monkeypatch)
    monkeypatch.setattr(gather_module, "event_now", simulated_event_now)
    monkeypatch.setattr(TwoTensor, "fsdp_pre_all_gather", _pre, raising=False)
    monkeypatch.setattr(TwoTensor, "fsdp_post_all_gather", _post, raising=False)
    if planted:
        monkeypatch.setattr(extension_module, "on_all_gather_stream", _unordered)
    results: list[Any] = run_threaded(_train, 2, kind, timeout=120)
    for races, accessed, hooks in results:
        assert accessed == {"compute", "all_gather", "reduce_scatter"}, accessed
        assert hooks == {"all_gather"}, hooks  # FSDP2's copy-in stream, not the compute one
        if planted:
            assert races, "the model saw no race where one was planted"
        else:
            assert races == [], races[:5]
