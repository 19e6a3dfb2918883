"""``load_full_state_dict``: a sharded checkpoint of any world size as full tensors, one process.

Numerics: export moves bits (gathering stored chunks), so the full tensors equal the values the
sharded model holds, bitwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_models import RNG_LOCK, TinyLlama, batches, loss_fn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor, init_device_mesh

import fsdp_engine
from fsdp_engine import (
    CheckpointError,
    IncompleteCheckpointError,
    load_full_state_dict,
    save_checkpoint,
)
from ragged_dtensor.testing import run_threaded

pytestmark = pytest.mark.numerics


class _Wrapper(torch.nn.Module):
    """Names its wrapped module ``_orig_mod``, as ``torch.compile``'s ``OptimizedModule`` does."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self._orig_mod = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._orig_mod(x)
        return out


def _train_and_save(rank: int, world: int, path: str, compiled_name: bool) -> dict[str, Any]:
    """Two steps of a sharded TinyLlama, saved as {"model", "optim"}; returns the full values."""
    with RNG_LOCK, torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyLlama(vocab=61)  # odd sizes: shard boundaries fall inside rows
    if compiled_name:  # the names torch.compile's wrapper gives (no compile needed for them)
        model.layers[0] = _Wrapper(model.layers[0])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.layers:
        fsdp_engine.fully_shard(layer, mesh=mesh)
    fsdp_engine.fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens in batches(2, world, vocab=61):
        loss_fn(model, tokens.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    save_checkpoint(state, path)
    full = {}
    for name, value in model.state_dict().items():
        full[name] = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
    return full


@pytest.mark.parametrize("world", [2, 3])
def test_full_tensors_of_a_sharded_checkpoint_equal_the_model(tmp_path: Path, world: int) -> None:
    path = str(tmp_path / "step_2")
    want = run_threaded(_train_and_save, world, path, False, timeout=120)[0]
    got = load_full_state_dict(path, prefix="model.")
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    # the optimizer's state is selectable the same way, at its global shapes
    moments = load_full_state_dict(path, prefix="optim.state.")
    assert moments["embed.weight.exp_avg"].shape == want["embed.weight"].shape
    # dtype casts floating-point tensors only
    halves = load_full_state_dict(path, prefix="model.", dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in halves.values())
    assert torch.equal(halves["head.weight"], want["head.weight"].to(torch.bfloat16))


def test_compile_wrapper_names_are_removed(tmp_path: Path) -> None:
    path = str(tmp_path / "step_2")
    want = run_threaded(_train_and_save, 2, path, True, timeout=120)[0]
    got = load_full_state_dict(path, prefix="model.")
    assert any(k.startswith("layers.0.") for k in got)
    assert not any("_orig_mod" in k for k in got)
    eager = {k.replace("._orig_mod", ""): v for k, v in want.items()}
    assert set(got) == set(eager)
    for name, value in eager.items():
        assert torch.equal(got[name], value), name


def test_refusals_name_the_path_and_prefix(tmp_path: Path) -> None:
    torn = tmp_path / "step_9"
    torn.mkdir()
    with pytest.raises(IncompleteCheckpointError, match="step_9"):
        load_full_state_dict(torn)
    done = save_checkpoint({"model": {"w": torch.ones(3)}}, tmp_path / "step_1")
    with pytest.raises(CheckpointError, match=r"'nope\.'.*'model\.w'"):
        load_full_state_dict(done, prefix="nope.")
    assert torch.equal(load_full_state_dict(done, prefix="model.")["w"], torch.ones(3))
