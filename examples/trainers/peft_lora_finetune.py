"""LoRA fine-tuning with PEFT through accelerate's FSDP2 plugin, on fsdp_engine, and the adapter
saved with PEFT's ``save_pretrained``:

torchrun --standalone --nproc-per-node 2 examples/trainers/peft_lora_finetune.py [OUTPUT_DIR]

(needs ``pip install "./examples[hf,finetune]"``; a pretrained model would come from
``from_pretrained``: here a small random-init LLaMA, so nothing is downloaded.)
"""

import sys
import tempfile

import torch
import transformers
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from peft import LoraConfig, get_peft_model
from trainer_setup import enable_accelerate_fsdp

import fsdp_engine

# the one line: torch.distributed.fsdp's FSDP2 names are fsdp_engine's from here on
fsdp_engine.use_as_torch_fsdp()

plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
on_cpu = not torch.cuda.is_available()
accelerator = Accelerator(fsdp_plugin=plugin, gradient_accumulation_steps=2, cpu=on_cpu)
if on_cpu:  # accelerate turns FSDP on for GPU launches only; this is what it does there
    enable_accelerate_fsdp(accelerator, plugin)

config = transformers.LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, use_cache=False,
)  # fmt: skip
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config)  # or from_pretrained(...)
lora = LoraConfig(task_type="CAUSAL_LM", r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
model = get_peft_model(model, lora)  # base weights frozen, LoRA adapters trainable
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)  # fsdp_engine.fully_shard, per layer
assert isinstance(model, fsdp_engine.FSDPModule)

data = torch.Generator().manual_seed(accelerator.process_index)
for step in range(8):
    tokens = torch.randint(0, 256, (2, 32), generator=data, device=accelerator.device)
    with accelerator.accumulate(model):
        loss = model(input_ids=tokens, labels=tokens).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.print(f"micro-batch {step}: loss {loss.item():.4f}")

# the adapter only: the full state dict gathered (every rank takes part), written by rank 0
output = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
state = accelerator.get_state_dict(model)
accelerator.unwrap_model(model).save_pretrained(
    output, state_dict=state, is_main_process=accelerator.is_main_process
)
accelerator.wait_for_everyone()
fsdp_engine.restore_torch_fsdp()
accelerator.print(f"adapter saved to {output}")
accelerator.print("ok")
