"""Per-rank bodies of the PEFT LoRA fine-tuning tests (``tests/test_finetune_lora.py``,
``nox -s finetune``): LoRA adapters from PEFT on a small random-init transformers LLaMA, trained
through accelerate's FSDP2 plugin and through transformers' ``Trainer``, once on torch's FSDP2
(the control) and once with ``fsdp_engine``'s switch on, in the same processes, on the same
data; then the adapter saved with PEFT's ``save_pretrained`` the way each stack saves it.

The harness (torchrun environment, the engines, the data, accelerate's CPU setup) is the
trainer tests' (``trainer_workers.py``); the comparisons are its [Note: comparisons of the
trainer tests]: kind (a) bitwise, kind (b) ``steps * sqrt(P) * eps32`` with P the number of
gradient elements in the norm (here the adapters' only: the frozen base weights have none).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import trainer_workers as tw

from ragged_dtensor.testing import count_collectives

hf = tw.hf  # examples/hf_models.py (trainer_workers puts examples/ on the path)
enable_accelerate_fsdp = tw.enable_accelerate_fsdp  # examples/trainers/trainer_setup.py

__all__ = ["LORA", "lora_model", "run_lora"]

# PEFT's usual LLaMA targets: the attention's query and value projections and the MLP's
# down projection, rank 8; no dropout, so both engines' runs draw nothing from the RNG
LORA: dict[str, Any] = {
    "r": 8,
    "lora_alpha": 16,
    "lora_dropout": 0.0,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
}


def lora_model() -> Any:
    """The tied-embedding LLaMA of the trainer tests with PEFT's LoRA adapters: every base
    weight frozen; PEFT's initialization (``lora_A`` Kaiming-uniform, ``lora_B`` zeros) from the
    seeded global generator, so every rank builds the same adapters."""
    from peft import LoraConfig, get_peft_model

    model = hf.build_model(hf.make_config("llama", vocab=tw.corpus().vocab, seq=tw.SEQ), seed=0)
    torch.manual_seed(tw.SEED + 1)
    return get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))


def _trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def accelerate_lora(
    rank: int,
    world: int,
    *,
    out: str,
    steps: int,
    accumulation: int = 1,
    mixed_precision: str = "no",
) -> dict[str, Any]:
    """``accelerator.prepare`` with ``FullyShardedDataParallelPlugin(fsdp_version=2)`` (every
    decoder layer, then the root), AdamW over the PEFT model's parameters, ``accumulate`` /
    ``backward``; then ``accelerator.get_state_dict`` (the full state dict) and PEFT's
    ``save_pretrained`` of the adapter on the main process, as accelerate documents it."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    tw._reset_accelerate()
    accelerator = Accelerator(
        cpu=True, gradient_accumulation_steps=accumulation, mixed_precision=mixed_precision
    )
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap"
    )
    enable_accelerate_fsdp(accelerator, plugin)
    model = lora_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=tw.LR)
    model, optimizer = accelerator.prepare(model, optimizer)
    losses, sent, calls = [], [], []
    for index in range(steps * accumulation):
        tokens = tw.batch(index, rank, world)
        with count_collectives() as counter, accelerator.accumulate(model):
            loss = model(input_ids=tokens, labels=tokens).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        sent.append(dict(counter.bytes))
        calls.append(dict(counter.calls))
    state = accelerator.get_state_dict(model)
    accelerator.unwrap_model(model).save_pretrained(
        out, state_dict=state, is_main_process=accelerator.is_main_process
    )
    accelerator.wait_for_everyone()
    result = {
        "losses": losses,
        "engine": tw.engine_of(model),
        "trainable": _trainable(model),
        # per micro-batch after the first step (the first also runs ours' one-time agreement
        # checks): each collective's bytes (count_collectives: the largest buffer of each call)
        "bytes": sent[accumulation:],
        "calls": calls[accumulation:],
    }
    tw._reset_accelerate()
    return result


def trainer_lora(
    rank: int, world: int, *, out: str, steps: int, accumulation: int, max_grad_norm: float
) -> dict[str, Any]:
    """transformers' ``Trainer`` with ``fsdp=True, fsdp_config={"version": 2}`` on the PEFT
    model (the trainer tests' CPU subclass, which records each micro-batch's loss), then
    ``trainer.save_model`` (FSDP2's default ``FULL_STATE_DICT``: the Trainer gathers the state
    dict through accelerate and calls PEFT's ``save_pretrained`` with it)."""
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
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            self.losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
            return loss

    tw._reset_accelerate()
    model = lora_model()
    windows = torch.cat(
        [
            hf.global_batch(tw.corpus(), i, size=tw.GLOBAL_BATCH, seq=tw.SEQ, seed=tw.SEED)
            for i in range(steps * accumulation)
        ]
    )
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "trainer"),
        use_cpu=True,
        fsdp=True,
        fsdp_config={"version": 2},
        max_steps=steps,
        per_device_train_batch_size=tw.GLOBAL_BATCH // world,
        gradient_accumulation_steps=accumulation,
        learning_rate=tw.LR,
        max_grad_norm=max_grad_norm,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=tw.SEED,
    )
    dataset = [{"input_ids": row, "labels": row} for row in windows]
    trainer = CPUFSDPTrainer(model=model, args=args, train_dataset=dataset)
    trainer.losses = []
    trainer.train()
    trainer.save_model(out)
    trainer.accelerator.wait_for_everyone()
    result = {
        "losses": trainer.losses,
        "engine": tw.engine_of(trainer.model),
        "trainable": _trainable(model),
    }
    tw._reset_accelerate()
    return result


def run_lora(rank: int, world: int, out: str, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each case (``name``, ``engine``, ``stack``: ``"accelerate"`` or ``"trainer"``, the run's
    options) in order; each saves its adapter under ``out/<name>-<engine>``."""
    tw.torchrun_env(rank, world)
    results = []
    for case in cases:
        options = {k: v for k, v in case.items() if k not in ("engine", "name", "stack")}
        options["out"] = os.path.join(out, f"{case['name']}-{case['engine']}")
        body = {"accelerate": accelerate_lora, "trainer": trainer_lora}[case["stack"]]
        with tw.engine(case["engine"]):
            results.append(body(rank, world, **options))
    return results
