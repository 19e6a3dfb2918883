"""optim_blockwise's FlatAdamW / FlatAdam on fsdp_engine's ``fully_shard``: torch's Adam(W) on
flat runs of each group's shard, with torch's param groups and per-parameter state, and its
checkpoints resharded by the engine's save / load.

Every comparison here is *same arithmetic* (bitwise): both sides run torch's own Adam kernels
element by element on the same gradients (same engine, same data), with 1 intra-op thread set
explicitly on every rank of both runs. The engine's test model and initial state come from
fsdp-engine's test helpers; the optimizer alone (plain parameters, hand-made flat storage) is
tested in ``packages/optim-blockwise/tests/test_optim_flat_adam.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "packages" / "fsdp-engine" / "tests"))

from engine_models import batches, build, loss_fn
from engine_training import initial_state

from fsdp_engine import fully_shard, load_checkpoint, save_checkpoint
from optim_blockwise import FlatAdam, FlatAdamW
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics

ROOT = Path(__file__).resolve().parents[1]

STEPS = 4


def param_groups(model: nn.Module, lr: float = 1e-2) -> list[dict[str, Any]]:
    """The usual recipe: decay for matrices, none for norms and biases (1-D), the embedding at
    its own learning rate."""
    decay, no_decay, embed = [], [], []
    for name, p in model.named_parameters():
        if name.startswith("embed"):
            embed.append(p)
        elif p.dim() >= 2:
            decay.append(p)
        else:
            no_decay.append(p)
    return [
        {"params": decay, "weight_decay": 0.1},
        {"params": no_decay, "weight_decay": 0.0, "lr": 2 * lr},
        {"params": embed, "weight_decay": 0.05, "lr": lr / 2, "betas": (0.8, 0.99)},
    ]


def _make(kind: str, model: nn.Module, **kwargs: Any) -> torch.optim.Optimizer:
    groups = param_groups(model)
    classes: dict[str, Any] = {
        "flat": FlatAdamW,
        "torch": torch.optim.AdamW,
        "flat-adam": FlatAdam,
        "torch-adam": torch.optim.Adam,
    }
    return classes[kind](groups, lr=1e-2, **kwargs)  # type: ignore[no-any-return]


def _sharded(world: int, policy: bool = False) -> nn.Module:
    mesh = init_device_mesh("cpu", (world,))
    model = build()
    model.load_state_dict(initial_state())
    extra: dict[str, Any] = {}
    if policy:  # whole rows: another plan, other runs
        extra["block_policy"] = lambda name, p: int(p.shape[-1]) if p.dim() == 2 else 1
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    return model


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().detach().clone()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and state tensor as a full tensor, by FQN (collective)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    out = {f"model.{k}": _full(v) for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            out[f"optim.{fqn}.{key}"] = _full(value)
    return out


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, start: int, steps: int
) -> list[float]:
    losses = []
    for tokens in batches(start + steps, world)[start:]:
        loss = loss_fn(model, tokens.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run(rank: int, world: int, kind: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(1)
    model = _sharded(world)
    opt = _make(kind, model, **kwargs)
    losses = _train(model, opt, rank, world, 0, STEPS)
    runs = getattr(opt, "runs_last_step", None)
    with_grad = sum(1 for p in model.parameters() if p.requires_grad)
    return {"losses": losses, "snapshot": _snapshot(model, opt), "runs": runs, "n": with_grad}


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for key, value in b.items():
        assert a[key].dtype == value.dtype and a[key].shape == value.shape, key
        assert torch.equal(a[key], value), f"{key}: not bit-identical"


@pytest.mark.parametrize("world", [2, 3])
def test_flat_adamw_equals_torch_adamw_with_param_groups(world: int) -> None:
    """Three param groups (decay / no decay at twice the lr / the embedding with its own lr and
    betas): losses, parameters and every state tensor (exp_avg, exp_avg_sq, step) bit-identical
    to torch.optim.AdamW with the same groups, in a fraction of the per-parameter tensors."""
    ours = run_threaded(_run, world, "flat", {}, timeout=120)
    ref = run_threaded(_run, world, "torch", {}, timeout=120)
    for a, b in zip(ours, ref, strict=True):
        assert a["losses"] == b["losses"]
        _assert_same(a["snapshot"], b["snapshot"])
        assert any(k.endswith("exp_avg_sq") for k in a["snapshot"])
        assert a["runs"] < a["n"], (a["runs"], a["n"])


def test_flat_adam_and_foreach_equal_torch() -> None:
    """Adam with L2 weight decay, and AdamW with torch's foreach kernels: the same bits."""
    for ours, theirs, kwargs in (
        ("flat-adam", "torch-adam", {"weight_decay": 0.01}),
        ("flat", "torch", {"foreach": True}),
    ):
        a = run_threaded(_run, 2, ours, kwargs, timeout=120)
        b = run_threaded(_run, 2, theirs, kwargs, timeout=120)
        for x, y in zip(a, b, strict=True):
            assert x["losses"] == y["losses"]
            _assert_same(x["snapshot"], y["snapshot"])


def _flat_runs(rank: int, world: int) -> tuple[int, int]:
    """One param group over 2 layers of 7 parameters + 4 root parameters: one run per
    ``fully_shard`` group (the planner leaves no gap here; empty local shares join a run)."""
    torch.set_num_threads(1)
    model = _sharded(world)
    opt = FlatAdamW(model.parameters(), lr=1e-2)
    _train(model, opt, rank, world, 0, 1)
    return opt.runs_last_step, sum(1 for _ in model.parameters())


def test_one_param_group_is_one_run_per_fully_shard_group() -> None:
    for runs, n in run_threaded(_flat_runs, 2, timeout=120):
        assert runs == 3 and n == 18, (runs, n)  # 2 layers + the root: one kernel set each


def _ckpt(
    rank: int, world: int, root: str, kind: str, load_from: str | None, save_to: str | None
) -> dict[str, Any]:
    """Train 2 steps (or load ``load_from``), snapshot, optionally save, then 2 more steps."""
    torch.set_num_threads(1)
    model = _sharded(world, policy=world == 3)
    opt = _make(kind, model)
    if load_from is None:
        _train(model, opt, rank, world, 0, 2)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_checkpoint(state, Path(root) / load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    snapshot = _snapshot(model, opt)
    if save_to is not None:
        model_sd, optim_sd = get_state_dict(model, opt)
        save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / save_to)
    losses = _train(model, opt, rank, world, 2, 2)
    return {"snapshot": snapshot, "after": _snapshot(model, opt), "losses": losses}


def test_state_reshards_across_world_sizes_and_interchanges_with_torch_adamw(
    tmp_path: Path,
) -> None:
    """Saved at 2 ranks, loaded at 4 (FlatAdamW), at 3 under another plan (torch.optim.AdamW),
    at 1 (FlatAdamW): every parameter and state tensor bit-identical to the save; from the same
    checkpoint, FlatAdamW and torch.optim.AdamW then continue bit-identically."""
    root = str(tmp_path)
    want = run_threaded(_ckpt, 2, root, "flat", None, "w2", timeout=120)[0]["snapshot"]
    assert any(k.endswith(".step") for k in want)
    phases = ((4, "flat", "w2", "w4"), (3, "torch", "w4", "w3"), (1, "flat", "w3", None))
    for world, kind, src, dst in phases:
        for got in run_threaded(_ckpt, world, root, kind, src, dst, timeout=120):
            _assert_same(got["snapshot"], want)
    flat = run_threaded(_ckpt, 2, root, "flat", "w4", None, timeout=120)
    ref = run_threaded(_ckpt, 2, root, "torch", "w4", None, timeout=120)
    for a, b in zip(flat, ref, strict=True):
        assert a["losses"] == b["losses"]
        _assert_same(a["after"], b["after"])


@pytest.mark.slow  # ~10 s idle, 30 s loaded (two gloo processes): beside quickstart's, not in CI
@pytest.mark.multiprocess
def test_readme_flat_adamw_example_is_the_file_and_runs() -> None:
    from ragged_dtensor.testing import run_readme_example

    package = ROOT / "packages" / "optim-blockwise"
    out = run_readme_example(package / "README.md", package / "examples" / "flat_adamw.py", index=3)
    assert out.strip().endswith("ok")
