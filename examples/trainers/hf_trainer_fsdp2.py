"""transformers' Trainer with FSDP2 on fsdp_engine:

torchrun --standalone --nproc-per-node 2 examples/trainers/hf_trainer_fsdp2.py
"""

import tempfile

import torch
import transformers
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from trainer_setup import enable_accelerate_fsdp

import fsdp_engine

# the one line: torch.distributed.fsdp's FSDP2 names are fsdp_engine's from here on (these
# trainers import them inside their functions, so it may come after their imports)
fsdp_engine.use_as_torch_fsdp()


class Trainer(transformers.Trainer):
    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.accelerator.state.distributed_type is DistributedType.MULTI_CPU:  # GPUs: not needed
            plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
            enable_accelerate_fsdp(self.accelerator, plugin)
            self.is_fsdp_enabled = True


config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_cache=False,
)  # fmt: skip
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)
rows = torch.randint(0, 256, (64, 32), generator=torch.Generator().manual_seed(0))
args = transformers.TrainingArguments(
    output_dir=tempfile.mkdtemp(),
    use_cpu=not torch.cuda.is_available(),
    fsdp=True,
    fsdp_config={"version": 2},  # FSDP2: accelerate calls torch.distributed.fsdp.fully_shard
    max_steps=4,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    logging_steps=1,
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
)
trainer = Trainer(
    model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in rows]
)
trainer.train()
assert isinstance(trainer.model, fsdp_engine.FSDPModule)
fsdp_engine.restore_torch_fsdp()
if trainer.is_world_process_zero():
    print("ok")
