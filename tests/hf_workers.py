"""Per-rank bodies of the Hugging Face tests (``test_hf_*.py``): train, checkpoint, resume, measure.

Everything runs on real gloo processes (``run_processes``) with one torch thread per process,
and the single-process references in the test process with one thread as well.

[Note: tolerances of the HF tests]
Two kinds of comparison, each stated where it is made:
(a) same arithmetic, compared bitwise: runs that execute the same kernels on the same values in
    the same order (a sharded forward on the all-gathered parameters and an unsharded model
    holding the same values; activation recompute against the stored activations).
(b) different arithmetic, ``LOSS_TOL`` relative: the sharded runs average the ranks' gradients
    of their half-batches, one process takes the gradient of the whole batch, and ours and
    FSDP2 may sum the two ranks' contributions in another order. Every gradient element is a
    sum over ``K = GLOBAL_BATCH * SEQ`` token terms; reordering a K-term fp32 sum moves it by
    about ``sqrt(K) * eps32`` relative (rounding errors add like a random walk). AdamW's update
    is invariant to the gradient's scale, so a relative gradient perturbation passes into the
    update one to one and compounds at most linearly over the steps:
    ``LOSS_TOL = STEPS * sqrt(K) * eps32`` (20 * 16 * 1.19e-7 = 3.8e-5).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # hf_*, llama

import hf_models as hf
import torch
import torch.distributed as dist
from llama import Corpus, load_corpus
from torch import nn
from torch.distributed.tensor import DTensor, init_device_mesh

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
GLOBAL_BATCH = 4  # sequences per step, split over the ranks (1, 2 or 4)
SEQ = 64
LR = 3e-3
SEED = 0
LOSS_TOL = STEPS * math.sqrt(GLOBAL_BATCH * SEQ) * torch.finfo(torch.float32).eps

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # nothing may be downloaded

_CORPUS: Corpus | None = None


def corpus() -> Corpus:
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = load_corpus()
    return _CORPUS


def config(name: str) -> Any:
    return hf.make_config(name, vocab=corpus().vocab, seq=SEQ)


def probe_input() -> torch.Tensor:
    """A fixed validation batch for comparing logits."""
    return hf.global_batch(corpus(), 10_000, size=2, seq=SEQ, split="val")


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)


def _fully_shard(engine: str) -> Any:
    if engine == "ours":
        import fsdp_engine

        return fsdp_engine.fully_shard
    import torch.distributed.fsdp as torch_fsdp

    return torch_fsdp.fully_shard


def _global_mean(loss: torch.Tensor, world: int) -> float:
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / world


def _state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}


def _save(model: nn.Module, opt: torch.optim.Optimizer, path: Path, step: int) -> None:
    import fsdp_engine

    meta = hf.checkpoint_metadata(model, step=step)
    fsdp_engine.save_checkpoint(_state(model, opt), path, metadata=meta)


def _load(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> int:
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    import fsdp_engine

    state = _state(model, opt)
    info = fsdp_engine.load_checkpoint(state, path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return int(info["metadata"]["step"])


def _tied(model: nn.Module) -> bool | None:
    """None for untied configs; else whether the head is still the embedding's parameter."""
    if not model.config.tie_word_embeddings:
        return None
    head = model.get_output_embeddings().weight
    embed = model.get_input_embeddings().weight
    return head is embed and isinstance(head, DTensor)


def _experts_hit(model: nn.Module) -> list[list[list[int]]]:
    """Filled during forward: per call of each MoE experts module, the experts that got tokens."""
    record: list[list[list[int]]] = []
    for module in model.modules():
        if type(module).__name__.endswith("Experts"):
            calls: list[list[int]] = []
            record.append(calls)

            def hook(mod: nn.Module, args: Any, calls: list[list[int]] = calls) -> None:
                calls.append(sorted(set(args[1].flatten().tolist())))

            module.register_forward_pre_hook(hook)
    return record


def train(
    rank: int,
    world: int,
    name: str,
    engine: str,
    *,
    steps: int = STEPS,
    save: dict[int, str] | None = None,
    resume: str | None = None,
    gradient_checkpointing: bool = False,
    compile_kwargs: dict[str, Any] | None = None,
    split: bool = False,
    exact_presence: bool = False,
) -> dict[str, Any]:
    """``name`` sharded with ``engine`` at ``world`` ranks; the global mean loss of each step.

    ``save``: step -> checkpoint directory, saved after that many steps. ``resume``: a checkpoint
    to continue from (its step is in the metadata) up to ``steps``. ``split``: one module per
    expert (``hf_models.split_experts``). ``exact_presence``: ours with
    ``set_reduce_scatter_unused_params(False)`` (a parameter no rank used has no ``.grad``, as with
    one process). Returns the losses, whether
    ties held, the experts each rank's batches hit, and the logits of ``probe_input()`` after
    the last step (sharded forward, no grad).
    """
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,))
    model = hf.build_model(config(name), seed=SEED)
    if split:
        hf.split_experts(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if compile_kwargs is not None:
        hf.compile_layers(model, **compile_kwargs)
    hits = _experts_hit(model)
    hf.shard_model(model, _fully_shard(engine), mesh=mesh)
    if exact_presence:
        model.set_reduce_scatter_unused_params(False)  # type: ignore[operator]
    opt = optimizer(model)
    start = _load(model, opt, Path(resume)) if resume else 0
    losses: list[float] = []
    for step in range(start, steps):
        batch = hf.global_batch(corpus(), step, size=GLOBAL_BATCH, seq=SEQ, seed=SEED)
        loss = hf.lm_loss(model, hf.rank_rows(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_global_mean(loss, world))
        if save and step + 1 in save:
            _save(model, opt, Path(save[step + 1]), step + 1)
    tied = _tied(model)  # after backward, when every group is sharded again
    with torch.no_grad():
        logits = model(input_ids=probe_input()).logits.detach().clone()
    return {"losses": losses, "tied": tied, "experts_hit": hits, "logits": logits}


def reference(name: str, steps: int = STEPS, *, split: bool = False) -> list[float]:
    """One process, the whole global batch each step, the same init, data and optimizer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = hf.build_model(config(name), seed=SEED)
        if split:
            hf.split_experts(model)
        opt = optimizer(model)
        losses = []
        for step in range(steps):
            batch = hf.global_batch(corpus(), step, size=GLOBAL_BATCH, seq=SEQ, seed=SEED)
            loss = hf.lm_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses
    finally:
        torch.set_num_threads(threads)


def assert_losses_close(got: list[float], want: list[float], what: str) -> None:
    """Kind (b) of [Note: tolerances of the HF tests]."""
    assert len(got) == len(want), (what, len(got), len(want))
    worst = max(abs(g - w) / max(1.0, abs(w)) for g, w in zip(got, want, strict=True))
    assert worst <= LOSS_TOL, f"{what}: relative difference {worst:.2e} > {LOSS_TOL:.2e}"


def train_many(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``train(**kwargs)`` for each of ``runs`` in turn, in the same processes (one start and
    one import of transformers for several runs)."""
    return [train(rank, world, **kwargs) for kwargs in runs]


def run(world: int, *runs: dict[str, Any], timeout: float = 300.0) -> list[list[dict[str, Any]]]:
    """``runs`` on ``world`` gloo processes, offline (nothing may be downloaded); result
    ``[run][rank]``."""
    from ragged_dtensor.testing import run_processes

    per_rank = run_processes(train_many, world, list(runs), timeout=timeout, env=ENV)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(runs))]
