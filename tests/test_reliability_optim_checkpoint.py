"""Checkpoints of optim_blockwise optimizers (Muon momentum, AdamW8bit codes and absmaxes) on
fsdp_engine-sharded models through torch.distributed.checkpoint: bit-exact at the same world size
and across 2 -> 4 -> 1 -> 2.

History: the optimizers used to keep their per-parameter state in ``state_dict()`` as plain
local tensors of this rank's shard; DCP treats a plain tensor as replicated (one rank's copy is
written and handed to every rank on load), so every other rank's state was lost: the load failed
with a size mismatch, or silently loaded rank 0's state where the lengths coincided.
``fsdp_engine.save_checkpoint`` refuses such state before writing (tested below with an
optimizer that still behaves that way).

Numerics: round trips move bits and resumed runs repeat the same arithmetic: bitwise.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, init_device_mesh

import optim_blockwise as ob
from fsdp_engine import CheckpointError, fully_shard, load_checkpoint, save_checkpoint
from ragged_dtensor.testing import run_threaded

pytestmark = [
    pytest.mark.numerics,
    # "adamw8bit-cut" shards without AdamW8bit's block policy on purpose (its warning is tested)
    pytest.mark.filterwarnings("ignore:AdamW8bit. parameter .* rank boundary:UserWarning"),
]

VOCAB, DIM = 64, 32
BLOCK = 32  # AdamW8bit block; the small model needs small blocks to have 8-bit state at all


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
            for _ in range(2)
        )
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _build(world: int, kind: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    gen = torch.Generator().manual_seed(0)
    model = Tiny()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    mesh = init_device_mesh("cpu", (world,))
    policy: Any
    if kind == "adamw8bit-cut":  # no block policy: shard boundaries cut quantization blocks
        policy = None
    elif kind == "adamw8bit":
        policy = ob.AdamW8bit.block_policy(block_size=BLOCK, min_8bit_size=2 * BLOCK)
    else:
        policy = ob.Muon.block_policy()
    for block in model.blocks:
        fully_shard(block, mesh=mesh, block_policy=policy)
    fully_shard(model, mesh=mesh, block_policy=policy)
    opt: torch.optim.Optimizer
    if kind == "adamw8bit":  # the optimizer's settings from the same policy
        opt = ob.AdamW8bit(model.parameters(), lr=1e-2, block_policy=policy)
    elif kind == "adamw8bit-cut":
        opt = ob.AdamW8bit(model.parameters(), lr=1e-2, block_size=BLOCK, min_8bit_size=2 * BLOCK)
    else:
        opt = ob.Muon(model.parameters(), lr=1e-2, ns_dtype=torch.float32)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> None:
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        tokens = torch.randint(0, VOCAB, (4, 9), generator=gen)
        local = tokens.chunk(world)[rank]
        logits = model(local[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), local[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad()


def _global_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters and optimizer states as full tensors (DTensors gathered)."""
    model_sd, optim_sd = get_state_dict(model, opt)
    out = {f"model.{k}": v.full_tensor() for k, v in model_sd.items()}
    for fqn, state in optim_sd["state"].items():
        for key, value in state.items():
            if isinstance(value, DTensor):
                out[f"optim.{fqn}.{key}"] = value.full_tensor()
            elif isinstance(value, torch.Tensor):
                out[f"optim.{fqn}.{key}"] = value.clone()
    return out


def _phase(
    rank: int, world: int, kind: str, root: str, load_from: str | None, save_to: str
) -> dict[str, torch.Tensor]:
    model, opt = _build(world, kind)
    if load_from is None:
        _train(model, opt, rank, world)
    else:
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        load_checkpoint(state, Path(root) / load_from)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_sd, optim_sd = get_state_dict(model, opt)
    save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / save_to)
    return _global_state(model, opt)


class LocalStateSGD(torch.optim.Optimizer):
    """Momentum SGD keeping its buffer as a plain tensor of this rank's local shard (what the
    blockwise optimizers' ``state_dict()`` used to expose)."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                local, grad = p.to_local(), p.grad.to_local()
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(local))
                buf.mul_(0.9).add_(grad)
                local.sub_(buf * group["lr"])


def _refusal(rank: int, world: int, root: str) -> str:
    model, _ = _build(world, "muon")
    opt = LocalStateSGD(model.parameters())
    _train(model, opt, rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    try:
        save_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "step_1")
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_save_checkpoint_refuses_per_rank_plain_optimizer_state(tmp_path: Path) -> None:
    """Nothing is silently lost: the save raises on every rank naming the state, and writes
    nothing."""
    key = "'optim.state.blocks.0.0.weight.momentum_buffer'"
    messages = run_threaded(_refusal, 2, str(tmp_path), timeout=120)
    for message in messages:
        assert key in message, message
        assert "differ between ranks" in message and "ranks [0]" in message, message
    assert not any(tmp_path.iterdir()), list(tmp_path.iterdir())


@pytest.mark.parametrize("kind", ["muon", "adamw8bit"])
@pytest.mark.parametrize("worlds", [(2, 2), (2, 4, 1, 2)], ids=["resume-2-2", "reshard-2-4-1-2"])
def test_blockwise_optimizer_state_round_trips_bit_exact(
    tmp_path: Path, kind: str, worlds: tuple[int, ...]
) -> None:
    """Muon momentum and 8-bit codes/absmaxes through DCP, at the same and other world sizes."""
    root = str(tmp_path)
    want = run_threaded(_phase, worlds[0], kind, root, None, "w0", timeout=120)[0]
    for i, world in enumerate(worlds[1:], start=1):
        for got in run_threaded(_phase, world, kind, root, f"w{i - 1}", f"w{i}", timeout=120):
            assert sorted(got) == sorted(want)
            for name, value in want.items():
                assert torch.equal(got[name], value), name


def _full_state_dict(rank: int, world: int, kind: str) -> str:
    model, opt = _build(world, kind)
    _train(model, opt, rank, world)
    try:
        _, optim_sd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ok" if optim_sd["state"] else "empty"


@pytest.mark.parametrize("kind", ["muon", "adamw8bit"])
def test_full_optimizer_state_dict(kind: str) -> None:
    """Regression (found here, fixed in 52b6751): for Muon, ``get_state_dict(...,
    StateDictOptions(full_state_dict=True))`` raised ``ValueError: Unexpected value type <class
    'torch.dtype'>``: ``ns_dtype`` (a ``torch.dtype``) sat in every param group and torch's
    ``_gather_state_dict`` accepts only tensors, containers and plain scalars there."""
    assert run_threaded(_full_state_dict, 2, kind, timeout=120) == ["ok", "ok"]


def _load_cut(rank: int, world: int, root: str) -> str:
    model, opt = _build(world, "adamw8bit-cut")
    model_sd, optim_sd = get_state_dict(model, opt)
    try:
        load_checkpoint({"model": model_sd, "optim": optim_sd}, Path(root) / "w0")
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_8bit_state_of_block_cutting_shards_refuses_another_layout(tmp_path: Path) -> None:
    """Without the optimizer's block policy, shard boundaries cut quantization blocks and both
    holders of an edge block keep its absmax, so the absmax vector's length depends on the
    layout. Loading at another world size must fail loudly, naming the state (a limitation:
    such a checkpoint only loads into the same layout), never mix blocks silently."""
    run_threaded(_phase, 2, "adamw8bit-cut", str(tmp_path), None, "w0", timeout=120)
    for message in run_threaded(_load_cut, 4, str(tmp_path), timeout=120):
        # load_checkpoint compares global shapes before any rank reads data (strict loading)
        assert "exp_avg_absmax': shape (" in message and "in the checkpoint" in message, message


_LOCK = threading.Lock()  # warnings' filters are process-wide: one rank records at a time


def _mismatched(
    rank: int, world: int, policy_to_optimizer: bool, engine_policy: bool = True
) -> list[str]:
    """Issue 28's case: fully_shard given AdamW8bit.block_policy(block_size=BLOCK) (so
    min_8bit_size=4096: every tensor of this model unconstrained), the optimizer
    min_8bit_size=2 * BLOCK (most of them kept in 8 bits)."""
    model = Tiny()
    mesh = init_device_mesh("cpu", (world,))
    policy = ob.AdamW8bit.block_policy(block_size=BLOCK)
    given = policy if engine_policy else None
    for block in model.blocks:
        fully_shard(block, mesh=mesh, block_policy=given)
    fully_shard(model, mesh=mesh, block_policy=given)
    kwargs: dict[str, Any] = {"block_policy": policy} if policy_to_optimizer else {}
    try:
        with _LOCK, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ob.AdamW8bit(model.parameters(), block_size=BLOCK, min_8bit_size=2 * BLOCK, **kwargs)
    except ValueError as exc:
        return [f"ValueError: {exc}"]
    return [str(w.message) for w in caught if "AdamW8bit" in str(w.message)]


def test_adamw8bit_settings_disagreeing_with_the_engines_block_policy_are_named() -> None:
    """Used to train, then fail to resume at another world size with only a shape mismatch of
    an absmax vector. Now refused at construction on every rank, naming both values: when the
    optimizer is given the policy, and when it is not (fully_shard records the policy on the
    sharded parameters, ``param.block_policy``). An engine given no policy: a warning naming a
    parameter whose shards cut its blocks and the policy fully_shard needs."""
    for out in run_threaded(_mismatched, 2, True, timeout=120):
        assert len(out) == 1 and out[0].startswith("ValueError: AdamW8bit(min_8bit_size=64)"), out
        assert "block_policy=AdamW8bitBlockPolicy(block_size=32, min_8bit_size=4096)" in out[0]
    for out in run_threaded(_mismatched, 2, False, timeout=120):
        assert len(out) == 1, out
        assert out[0].startswith(
            "ValueError: AdamW8bit(min_8bit_size=64) disagrees with the block policy parameter"
        ), out
        assert (
            "AdamW8bitBlockPolicy(block_size=32, min_8bit_size=4096) (min_8bit_size=4096)"
            in (out[0])
        )
    for out in run_threaded(_mismatched, 2, False, False, timeout=120):
        assert len(out) == 1 and "is sharded with a rank boundary at element" in out[0], out
        assert "AdamW8bit.block_policy(block_size=32, min_8bit_size=64)" in out[0], out
