"""Per-rank bodies of the trainer tests (``test_trainers_*.py``, ``nox -s trainers``): real
trainers that import FSDP2 themselves, run once on torch's FSDP2 (the control) and once with
``fsdp_engine.as_torch_fsdp()`` switched on, in the same processes, on the same data.

Each trainer is set up the way its users set it up, on CPU and gloo, with 2 ranks started by
``run_processes`` and the environment of a ``torchrun`` launch (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ...; the process group is already initialized, which every trainer here
accepts). Models are built from configs with random init; nothing is downloaded (the tests
run with ``HF_HUB_OFFLINE=1``). Data: characters of the pydoc topics text that ships with
CPython (``examples/llama.py``), the same windows for both engines.

[Note: comparisons of the trainer tests]
(a) same arithmetic, compared bitwise: the switched run executes the same kernels on the same
    values in the same order as FSDP2 (forward and backward on the all-gathered parameters;
    each gradient element a two-term sum over the ranks, scaled the same way; the optimizer on
    the same shard values), so every loss of every rank is bitwise FSDP2's.
(b) different arithmetic: ``clip_grad_norm_`` sums the squares of the P gradient elements in
    the ranks' shards; our shards are contiguous blocks (RaggedShard), FSDP2's are row blocks
    (``Shard(0)``), so the P-term fp32 sum is taken in another order. Rounding errors of a
    reordered P-term sum add like a random walk: relative error about ``sqrt(P) * eps32`` in the
    norm, and so in the clip coefficient that scales every gradient; AdamW passes a relative
    gradient perturbation into the update one to one, compounding at most linearly over the
    steps: ``tol = steps * sqrt(P) * eps32`` relative on each loss.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))  # hf_models, llama
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "trainers"))

import hf_models as hf
from llama import Corpus, load_corpus
from trainer_setup import enable_accelerate_fsdp, torchtitan_llama

import fsdp_engine

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
SEQ = 32
GLOBAL_BATCH = 4  # sequences per micro-batch, split over the ranks
SEED = 0
LR = 3e-3
EPS32 = torch.finfo(torch.float32).eps

_CORPUS: Corpus | None = None


def corpus() -> Corpus:
    global _CORPUS
    if _CORPUS is None:
        _CORPUS = load_corpus()
    return _CORPUS


def batch(index: int, rank: int, world: int, *, seq: int = SEQ) -> torch.Tensor:
    """This rank's rows of micro-batch ``index`` (``seq`` tokens each)."""
    rows = hf.global_batch(corpus(), index, size=GLOBAL_BATCH, seq=seq, seed=SEED)
    return hf.rank_rows(rows, rank, world)


def torchrun_env(rank: int, world: int) -> None:
    """What ``torchrun`` puts in a rank's environment (trainers read it to find their rank);
    the process group itself is already up (``run_processes``)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        ROLE_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
        TORCHELASTIC_RUN_ID="trainer-tests",  # Lightning: processes started externally
    )


@contextlib.contextmanager
def engine(name: str, modules: Sequence[str] = ()) -> Iterator[None]:
    """``"fsdp2"``: torch's FSDP2 as it is; ``"ours"``: ``fsdp_engine.as_torch_fsdp()``."""
    if name == "fsdp2":
        assert not fsdp_engine.used_as_torch_fsdp()
        yield
    elif name == "ours":
        with fsdp_engine.as_torch_fsdp(modules=modules):
            yield
    else:
        raise ValueError(f"engine must be 'fsdp2' or 'ours', got {name!r}")


def engine_of(model: nn.Module) -> str:
    """Which engine sharded ``model``: ours puts ``fsdp_engine.FSDPModule`` in its class."""
    if isinstance(model, fsdp_engine.FSDPModule):
        return "ours"
    import torch.distributed.fsdp._fully_shard._fully_shard as torch_fsdp2

    return "fsdp2" if isinstance(model, torch_fsdp2.FSDPModule) else "none"


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def clip_tolerance(parameters: int, steps: int) -> float:
    """Kind (b) of [Note: comparisons of the trainer tests]."""
    return steps * math.sqrt(parameters) * EPS32


# -- accelerate ----------------------------------------------------------------------------------


def _reset_accelerate() -> None:
    """accelerate keeps its state in process-wide singletons: a new run starts from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerate_run(
    rank: int,
    world: int,
    *,
    accumulation: int = 1,
    mixed_precision: str = "no",
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    checkpoint_dir: str | None = None,
    state_dict_type: str = "SHARDED_STATE_DICT",
    steps: int = 4,
) -> dict[str, Any]:
    """A tied-embedding LLaMA through ``accelerator.prepare`` with the FSDP2 plugin, AdamW,
    ``accelerator.accumulate`` / ``backward``; the loss of every micro-batch of this rank.

    ``checkpoint_dir``: ``accelerator.save_state`` there after the first half of the steps,
    train the second half, ``accelerator.load_state`` and train the second half again
    (``"resumed"``: its losses). ``state_dict_type``: the plugin's checkpoint format
    (``"FULL_STATE_DICT"``: full tensors written by rank 0 and loaded with torch's
    ``set_*_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)``)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    _reset_accelerate()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",  # each decoder layer (model._no_split_modules)
        activation_checkpointing=activation_checkpointing,
        reshard_after_forward=reshard_after_forward,
        state_dict_type=state_dict_type,
    )
    enable_accelerate_fsdp(accelerator, plugin)
    assert accelerator.is_fsdp2 and accelerator.num_processes == world
    model = hf.build_model(hf.make_config("llama", vocab=corpus().vocab, seq=SEQ), seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer = accelerator.prepare(model, optimizer)

    def train(first: int, last: int) -> list[float]:
        losses = []
        for index in range(first * accumulation, last * accumulation):
            tokens = batch(index, rank, world)
            with accelerator.accumulate(model):
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
        return losses

    half = steps // 2
    losses = train(0, half)
    if checkpoint_dir is not None:
        accelerator.save_state(checkpoint_dir)
    losses += train(half, steps)
    resumed = None
    if checkpoint_dir is not None:
        accelerator.load_state(checkpoint_dir)
        resumed = train(half, steps)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"losses": losses, "resumed": resumed, "engine": engine_of(model), "tied": tied}


def run_accelerate(
    rank: int, world: int, out: str, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each case (``name``, ``engine``, ``accelerate_run``'s options; ``save_load``: a
    checkpoint directory of its own under ``out``) in order."""
    torchrun_env(rank, world)
    results = []
    for case in cases:
        options = {k: v for k, v in case.items() if k not in ("engine", "name", "save_load")}
        if case.get("save_load"):
            options["checkpoint_dir"] = os.path.join(out, f"{case['name']}-{case['engine']}")
        with engine(case["engine"]):
            results.append(accelerate_run(rank, world, **options))
    _reset_accelerate()
    return results


# -- Lightning -----------------------------------------------------------------------------------


class TinyLM(nn.Module):
    """Embedding, two residual MLP blocks, a head: what a Lightning user shards by hand."""

    def __init__(self, vocab: int, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
            )
            for _ in range(2)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        out: torch.Tensor = self.head(h)
        return out


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def shard_tiny(model: TinyLM, mesh: Any) -> TinyLM:
    """The user's sharding code, written against torch's FSDP2 (resolved at call time, so the
    switch decides whose ``fully_shard`` runs)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _tiny() -> TinyLM:
    torch.manual_seed(SEED)
    return TinyLM(corpus().vocab)


def lightning_run(
    rank: int,
    world: int,
    *,
    accumulation: int,
    steps: int = 4,
    precision: str = "32-true",
    checkpoint_dir: str | None = None,
) -> dict[str, Any]:
    """``lightning.Trainer`` with ``ModelParallelStrategy`` on CPU; the module shards itself in
    ``configure_model`` with torch's ``fully_shard``; ``accumulate_grad_batches``; Lightning's
    ``precision`` (``"bf16-mixed"``: its CPU autocast).

    ``checkpoint_dir``: a fit of half the steps, ``trainer.save_checkpoint`` there (Lightning's
    distributed checkpoint: the sharded model and optimizer through DCP), then a new module and
    trainer resumed from it (``fit(ckpt_path=...)``) to the end (``"resumed"``: its losses);
    ``"losses"`` are an uninterrupted fit's. Each step then takes the micro-batch of its global
    step (Lightning restarts a plain DataLoader's epoch on resume), and ``accumulation`` must
    be 1."""
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy

    by_step = checkpoint_dir is not None
    if by_step and accumulation != 1:
        raise ValueError("lightning_run: checkpoint_dir needs accumulation=1")

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _tiny()
            self.losses: list[float] = []

        def configure_model(self) -> None:
            shard_tiny(self.net, self.device_mesh["data_parallel"])

        def training_step(self, batch_: Any, index: int) -> torch.Tensor:
            tokens = batch(self.global_step, rank, world) if by_step else batch_[0]
            loss = lm_loss(self.net, tokens)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=LR)

    # the global rows of each micro-batch in order: Lightning's DistributedSampler (no shuffle)
    # gives rank r the rows r, r + world, ...
    windows = torch.cat(
        [
            hf.global_batch(corpus(), i, size=GLOBAL_BATCH, seq=SEQ, seed=SEED)
            for i in range(steps * accumulation)
        ]
    )
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(windows), batch_size=GLOBAL_BATCH // world, shuffle=False
    )

    def fit(max_steps: int, resume: str | None = None, save: str | None = None) -> Module:
        module = Module()
        trainer = L.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
            max_steps=max_steps,
            accumulate_grad_batches=accumulation,
            precision=precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, loader, ckpt_path=resume)
        if save is not None:
            trainer.save_checkpoint(save)
        return module

    module = fit(steps)
    resumed = None
    if checkpoint_dir is not None:
        fit(steps // 2, save=checkpoint_dir)
        resumed = fit(steps, resume=checkpoint_dir).losses
    return {"losses": module.losses, "resumed": resumed, "engine": engine_of(module.net)}


def fabric_run(rank: int, world: int, *, accumulation: int, steps: int = 4) -> dict[str, Any]:
    """``lightning.Fabric`` with ``ModelParallelStrategy(parallelize_fn=...)`` and gradient
    accumulation under ``fabric.no_backward_sync`` (which toggles
    ``set_requires_gradient_sync`` on every module that is ``isinstance`` torch's
    ``FSDPModule``); counts the reduce-scatters issued in the micro-batches it covers."""
    import lightning as L
    from lightning.fabric.strategies import ModelParallelStrategy

    from ragged_dtensor.testing import count_collectives

    def parallelize(model: TinyLM, mesh: Any) -> TinyLM:
        return shard_tiny(model, mesh["data_parallel"])

    fabric = L.Fabric(
        accelerator="cpu",
        devices=world,
        strategy=ModelParallelStrategy(
            parallelize_fn=parallelize, data_parallel_size=world, tensor_parallel_size=1
        ),
    )
    fabric.launch()
    model = fabric.setup_module(_tiny())
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=LR))
    losses = []
    unsynced_reductions = 0
    for step in range(steps):
        for micro in range(accumulation):
            tokens = batch(step * accumulation + micro, rank, world)
            last = micro == accumulation - 1
            with count_collectives() as counter, fabric.no_backward_sync(model, enabled=not last):
                loss = lm_loss(model, tokens)
                fabric.backward(loss / accumulation)
            if not last:
                unsynced_reductions += sum(
                    n for name, n in counter.calls.items() if "reduce_scatter" in name
                )
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return {
        "losses": losses,
        "engine": engine_of(model.module),
        "unsynced_reductions": unsynced_reductions,
    }


def run_lightning(
    rank: int, world: int, out: str, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each case (``name``, ``engine``, ``api``, the run's options; ``save_load``: a checkpoint
    directory of its own under ``out``) in order."""
    torchrun_env(rank, world)
    results = []
    for case in cases:
        options = {k: v for k, v in case.items() if k not in ("engine", "name", "api", "save_load")}
        if case.get("save_load"):
            options["checkpoint_dir"] = os.path.join(out, f"{case['name']}-{case['engine']}")
        body = {"trainer": lightning_run, "fabric": fabric_run}[case["api"]]
        with engine(case["engine"]):
            results.append(body(rank, world, **options))
    return results


# -- transformers' Trainer -----------------------------------------------------------------------


def transformers_run(
    rank: int,
    world: int,
    *,
    accumulation: int,
    max_grad_norm: float,
    steps: int = 4,
    output_dir: str | None = None,
    save_steps: int | None = None,
    resume_from: str | None = None,
) -> dict[str, Any]:
    """``transformers.Trainer`` with ``fsdp=True, fsdp_config={"version": 2}`` on a tiny
    random-init LLaMA. On CPU, accelerate (which the Trainer builds from the FSDP plugin
    arguments it derives from ``fsdp_config``) stops at ``MULTI_CPU``: the Trainer subclass
    finishes the accelerator the way a GPU launch would (``enable_accelerate_fsdp``).

    ``save_steps``: the Trainer's own checkpoints every that many steps (its default format
    under FSDP2: ``FULL_STATE_DICT``) in ``output_dir``; ``resume_from``: a checkpoint directory
    to resume from (``trainer.train(resume_from_checkpoint=...)``)."""
    import transformers
    from accelerate.utils import FullyShardedDataParallelPlugin

    class CPUFSDPTrainer(transformers.Trainer):  # type: ignore[misc]
        losses: list[float]

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            enable_accelerate_fsdp(self.accelerator, plugin)
            self.is_fsdp_enabled = True

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append((out[0] if isinstance(out, tuple) else out).item())
            return out

    _reset_accelerate()
    model = hf.build_model(hf.make_config("llama", vocab=corpus().vocab, seq=SEQ), seed=SEED)
    windows = torch.cat(
        [hf.global_batch(corpus(), i, size=GLOBAL_BATCH, seq=SEQ, seed=SEED) for i in range(16)]
    )
    dataset = [{"input_ids": row, "labels": row} for row in windows]
    args = transformers.TrainingArguments(
        output_dir=output_dir or os.environ["TRAINER_TEST_OUT"],
        use_cpu=True,
        fsdp=True,
        fsdp_config={"version": 2},
        max_steps=steps,
        per_device_train_batch_size=GLOBAL_BATCH // world,
        gradient_accumulation_steps=accumulation,
        learning_rate=LR,
        max_grad_norm=max_grad_norm,
        report_to=[],
        save_strategy="no" if save_steps is None else "steps",
        save_steps=save_steps or 500,
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=SEED,
    )
    trainer = CPUFSDPTrainer(model=model, args=args, train_dataset=dataset)
    trainer.losses = []
    trainer.train(resume_from_checkpoint=resume_from)
    result = {
        "losses": trainer.losses,
        "engine": engine_of(trainer.model),
        "parameters": parameter_count(model),
    }
    _reset_accelerate()
    return result


def run_transformers(
    rank: int, world: int, out: str, cases: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    torchrun_env(rank, world)
    os.environ["TRAINER_TEST_OUT"] = out
    results = []
    for case in cases:
        options = {k: v for k, v in case.items() if k not in ("engine", "resume")}
        if not case.get("resume"):
            with engine(case["engine"]):
                results.append(transformers_run(rank, world, **options))
            continue
        # a run that saves its checkpoints, then a new Trainer resumed from the middle one
        steps = options.get("steps", 4)
        directory = os.path.join(out, f"resume-{case['engine']}")
        with engine(case["engine"]):
            result = transformers_run(
                rank, world, **options, output_dir=directory, save_steps=steps // 2
            )
            middle = os.path.join(directory, f"checkpoint-{steps // 2}")
            resumed = transformers_run(rank, world, **options, resume_from=middle)
        result["resumed"] = resumed["losses"]
        result["resumed_engine"] = resumed["engine"]
        results.append(result)
    return results


# -- torchtitan ----------------------------------------------------------------------------------

TORCHTITAN_FSDP = "torchtitan.distributed.fsdp"  # binds FSDP2's names at its import


def torchtitan_run(
    rank: int, world: int, *, force_sum: bool, accumulation: int = 2, steps: int = 3
) -> dict[str, Any]:
    """torchtitan's FSDP helpers on its model: ``apply_fsdp_to_decoder`` (every block, then
    ``[norm, lm_head]``, the embedding and the root; then its gradient-division switch
    ``disable_fsdp_gradient_division``, which skips modules that are not ``isinstance`` torch's
    ``FSDPModule``), its ``ChunkedLossWrapper`` (which unshards and reshards ``lm_head`` and
    toggles its gradient sync, again only for an ``FSDPModule``) over its sum-reduced
    ``CrossEntropyLoss`` divided by the global token count, as its trainer does, and gradient
    accumulation without no-sync (its trainer's). SGD: the update is the gradient's scale, so a
    gradient division that was not turned off would show at once. Returns the losses and the
    first step's full gradients.

    ``force_sum``: ``set_force_sum_reduction_for_comms(True)`` on every sharded module after
    torchtitan's helpers ran. FSDP2 needs it on gloo: with the divide factor 1.0 that
    torchtitan sets, FSDP2 reduce-scatters fp32 gradients with ``ReduceOp.PREMUL_SUM(1.0)``,
    which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); forced to ``SUM``, a
    factor of 1 divides nothing. torchtitan sets the same switch itself with symmetric
    memory. fsdp_engine runs torchtitan's setting as it is (a plain sum)."""
    from torch.distributed.tensor import init_device_mesh
    from torchtitan.components.loss import ChunkedLossWrapper

    module = importlib.import_module(TORCHTITAN_FSDP)

    model = torchtitan_llama(corpus().vocab, SEQ)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    module.apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    if force_sum:
        from torch.distributed.fsdp._fully_shard._fully_shard import FSDPModule

        for sharded in model.modules():
            if isinstance(sharded, FSDPModule):  # torch's class: ours subclass it
                sharded.set_force_sum_reduction_for_comms(True)
    loss_fn = ChunkedLossWrapper(ChunkedLossWrapper.Config(num_chunks=2))
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True  # the trainer's setting with ChunkedLossWrapper
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, grads = [], {}
    for step in range(steps):
        # SEQ + 1 tokens: SEQ inputs and targets (the loss's chunks split SEQ evenly)
        micro = [
            batch(step * accumulation + m, rank, world, seq=SEQ + 1) for m in range(accumulation)
        ]
        tokens = torch.tensor(sum(t[:, 1:].numel() for t in micro), dtype=torch.int64)
        dist.all_reduce(tokens)  # the trainer's global_valid_tokens
        total = 0.0
        for t in micro:
            hidden = model(t[:, :-1])
            loss, _ = loss_fn(hidden, t[:, 1:], global_valid_tokens=tokens)
            loss.backward()
            total += loss.item()
        if step == 0:
            grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return {"losses": losses, "grads": grads, "engine": engine_of(model)}


def run_torchtitan(rank: int, world: int, order: str) -> dict[str, Any]:
    """``order="named"``: torchtitan imported first (its fsdp module binds torch's FSDP2),
    FSDP2's run, then ours with that module named to the switch. ``order="switch-first"``:
    the switch on before torchtitan is imported (its module binds ours); ours only."""
    torchrun_env(rank, world)
    results: dict[str, Any] = {}
    if order == "named":
        importlib.import_module(TORCHTITAN_FSDP)
        results["fsdp2"] = torchtitan_run(rank, world, force_sum=True)
        with engine("ours", modules=[TORCHTITAN_FSDP]):
            results["ours"] = torchtitan_run(rank, world, force_sum=True)
            results["ours as torchtitan sets it"] = torchtitan_run(rank, world, force_sum=False)
        module = sys.modules[TORCHTITAN_FSDP]
        results["restored"] = not any(
            getattr(module, name) is getattr(fsdp_engine, name)
            for name in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "CPUOffloadPolicy")
        )
    elif order == "switch-first":
        assert TORCHTITAN_FSDP not in sys.modules
        fsdp_engine.use_as_torch_fsdp()
        results["ours"] = torchtitan_run(rank, world, force_sum=False)
        fsdp_engine.restore_torch_fsdp()
    else:
        raise ValueError(f"order must be 'named' or 'switch-first', got {order!r}")
    return results
