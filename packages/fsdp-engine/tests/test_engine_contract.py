"""FSDP2's public contract (torch 2.13's ``torch.distributed.fsdp`` and ``_fully_shard``), row by
row of the README's "FSDP2's contract" table, with torch's FSDP2 as the control wherever it runs
on CPU (threaded process group unless a row needs processes).

Numeric kind of every value comparison here: *same arithmetic* (same kernels on the same
unsharded values, one thread per rank, a two-rank mean is a two-term sum times 1/2): bitwise.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from engine_fsdp2 import (
    REDUCE_SCATTER,
    Mlp,
    Stack,
    counting,
    data,
    engine,
    full_grads,
    make,
    shard_stack,
)
from torch import nn

import fsdp_engine
from ragged_dtensor.testing import run_threaded

ENGINES = ["ours", "fsdp2"]


# -- isinstance(m, torch.distributed.fsdp.FSDPModule) ---------------------------------------------
def _is_torch_fsdp_module(rank: int, world: int) -> Any:
    model = make(Stack)
    shard_stack(fsdp_engine, model)
    modules = [model, *model.blocks]
    handle = model.blocks[0].unshard(async_op=True)  # type: ignore[operator]
    assert handle is not None
    handle.wait()
    model.blocks[0].reshard()  # type: ignore[operator]
    return (
        [isinstance(m, torch_fsdp.FSDPModule) for m in modules],
        [isinstance(m, fsdp_engine.FSDPModule) for m in modules],
        [type(m).__mro__[1:4] for m in modules],
        isinstance(handle, torch_fsdp.UnshardHandle),
        isinstance(model.proj, torch_fsdp.FSDPModule),  # a plain submodule stays plain
    )


def test_our_modules_are_torchs_fsdp_modules_with_our_class_first() -> None:
    """Trainers check ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (torchtitan's
    gradient-division switch, Lightning Fabric's no-sync toggle): true for every module
    ``fsdp_engine.fully_shard`` was applied to, and ``fsdp_engine.FSDPModule`` stays first in
    the MRO (ours, torch's, then the original class); an unshard handle is torch's too."""
    theirs, ours, mros, handle_is_torchs, plain = run_threaded(_is_torch_fsdp_module, 2)[0]
    assert all(theirs) and all(ours)
    assert mros[0] == (fsdp_engine.FSDPModule, torch_fsdp.FSDPModule, Stack)
    assert all(mro == (fsdp_engine.FSDPModule, torch_fsdp.FSDPModule, Mlp) for mro in mros[1:])
    assert handle_is_torchs and not plain


_NOT_METHODS = {"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__"}


def _methods(cls: type) -> dict[str, Any]:
    return {
        name: value
        for name, value in vars(cls).items()
        if name not in _NOT_METHODS
        and (callable(value) or isinstance(value, (staticmethod, classmethod, property)))
    }


def test_every_method_of_torchs_fsdp_module_is_overridden_by_ours() -> None:
    """None of torch's FSDPModule methods (they reach for torch's private per-module state) is
    ever run on our modules: ours defines every one torch's defines, public and private, so this
    fails the day torch adds one we do not override. Each keeps torch's parameter names and
    defaults (ours may add keyword-only ones)."""
    torchs = _methods(torch_fsdp.FSDPModule)
    ours = _methods(fsdp_engine.FSDPModule)
    missing = sorted(set(torchs) - set(ours))
    assert not missing, f"torch's FSDPModule methods fsdp_engine does not override: {missing}"
    assert {"reshard", "unshard", "set_requires_gradient_sync", "_get_fsdp_state"} <= set(torchs)
    for name, theirs in torchs.items():
        if name == "__new__" or not inspect.isfunction(theirs):
            continue
        want = inspect.signature(theirs).parameters
        got = inspect.signature(ours[name]).parameters
        for param in want.values():
            assert param.name in got, (name, param.name)
            mine = got[param.name]
            assert (mine.kind, mine.default) == (param.kind, param.default), (name, param.name)
    for name in torchs:  # the generated class finds ours first
        fsdp_cls = type("FSDPLinear", (fsdp_engine.FSDPModule, nn.Linear), {})
        assert inspect.getattr_static(fsdp_cls, name) is inspect.getattr_static(
            fsdp_engine.FSDPModule, name
        ), name


def _trainer_style(rank: int, world: int, impl: str) -> Any:
    """What trainers do with the modules that pass ``isinstance``: torchtitan turns off the
    division (``set_gradient_divide_factor(1.0)``, with ``set_force_sum_reduction_for_comms``
    on backends without a pre-multiplied sum), Fabric's no-sync toggles gradient sync."""
    torch.set_num_threads(1)
    model = make(Stack)
    shard_stack(engine(impl), model)
    fsdp_modules = [m for m in model.modules() if isinstance(m, torch_fsdp.FSDPModule)]
    for m in fsdp_modules:
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # the threaded group has no PREMUL_SUM
    for m in fsdp_modules:
        m.set_requires_gradient_sync(False, recurse=False)
    with counting() as no_sync:
        model(data(rank, 0)).sum().backward()
    for m in fsdp_modules:
        m.set_requires_gradient_sync(True, recurse=False)
    with counting() as synced:
        model(data(rank, 1)).sum().backward()
    return (
        len(fsdp_modules),
        no_sync.get(REDUCE_SCATTER, 0),
        synced[REDUCE_SCATTER],
        full_grads(model),
    )


def test_trainers_isinstance_checks_reach_our_setters_like_fsdp2s() -> None:
    """Code written against torch's class finds our modules and its setters act as on FSDP2's:
    no reduce-scatter while sync is off, the sum (divide factor 1) of both microbatches after."""
    ours = run_threaded(_trainer_style, 2, "ours")
    theirs = run_threaded(_trainer_style, 2, "fsdp2")
    for (n1, off1, on1, g1), (n2, off2, on2, g2) in zip(ours, theirs, strict=True):
        assert (n1, off1) == (n2, off2) == (3, 0)
        assert on1 == on2 == 3
        for name, grad in g2.items():
            assert torch.equal(g1[name], grad), name  # type: ignore[arg-type]


class _Features(Mlp):
    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.up(x))


class _Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vision = _Features()
        self.head = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.vision.features(x))  # not the submodule's ``forward``


def _torch_forward_method(rank: int, world: int) -> Any:
    torch.set_num_threads(1)
    out = []
    for register in (
        torch_fsdp.register_fsdp_forward_method,
        fsdp_engine.register_fsdp_forward_method,
    ):
        model = make(_Tower)
        fsdp_engine.fully_shard(model.vision)
        fsdp_engine.fully_shard(model)
        register(model.vision, "features")
        loss = model(data(rank)).sum()
        loss.backward()
        out.append((loss.detach(), full_grads(model)))
    return out


def test_torchs_register_fsdp_forward_method_works_on_our_modules() -> None:
    """``torch.distributed.fsdp.register_fsdp_forward_method`` (what libraries import) applied
    to our module unshards around the method like ours does: it asks the module for its state
    (``_get_fsdp_state``), and ours has FSDP2's ``_pre_forward``/``_post_forward``."""
    for (l1, g1), (l2, g2) in run_threaded(_torch_forward_method, 2):
        assert torch.equal(l1, l2)
        for name, grad in g2.items():
            assert torch.equal(g1[name], grad), name  # type: ignore[arg-type]
