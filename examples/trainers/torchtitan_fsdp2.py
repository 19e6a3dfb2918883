"""torchtitan's FSDP helpers on fsdp_engine:

torchrun --standalone --nproc-per-node 2 examples/trainers/torchtitan_fsdp2.py
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import init_device_mesh
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
from trainer_setup import torchtitan_llama

import fsdp_engine

# torchtitan's fsdp module bound torch's FSDP2 names when it was imported (above): name it, and
# the switch rebinds them too (or switch on before importing torchtitan)
fsdp_engine.use_as_torch_fsdp(modules=["torchtitan.distributed.fsdp"])

device = "cuda" if torch.cuda.is_available() else "cpu"
dist.init_process_group("nccl" if device == "cuda" else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
if device == "cuda":
    torch.cuda.set_device(rank % torch.cuda.device_count())
mesh = init_device_mesh(device, (world,), mesh_dim_names=("fsdp",))

model = torchtitan_llama(vocab=256, seq=32).to(device)
# every block, [norm, lm_head], the embedding, the root; then the gradient division off
apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32,
                      pp_enabled=False)  # fmt: skip
assert all(isinstance(b, fsdp_engine.FSDPModule) for b in model.layers.values())

optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
data = torch.Generator().manual_seed(rank)
for step in range(4):
    tokens = torch.randint(0, 256, (2, 33), generator=data).to(device)
    global_tokens = torch.tensor(tokens[:, 1:].numel(), device=device)
    dist.all_reduce(global_tokens)  # torchtitan's loss: summed, over the global token count
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
    (loss / global_tokens).backward()
    optimizer.step()
    optimizer.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item() / tokens[:, 1:].numel():.4f}")

fsdp_engine.restore_torch_fsdp()
dist.destroy_process_group()
if rank == 0:
    print("ok")
