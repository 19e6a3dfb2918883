"""Lightning's ModelParallelStrategy on fsdp_engine:

torchrun --standalone --nproc-per-node 2 examples/trainers/lightning_fsdp2.py
"""

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

import fsdp_engine

# the one line: torch.distributed.fsdp's FSDP2 names are fsdp_engine's from here on (these
# trainers import them inside their functions, so it may come after their imports)
fsdp_engine.use_as_torch_fsdp()


class LM(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 64)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
            for _ in range(2)
        )
        self.head = nn.Linear(64, 256)

    def configure_model(self) -> None:  # the code you have for FSDP2, unchanged
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)
        assert isinstance(self, fsdp_engine.FSDPModule)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + block(h)
        out: torch.Tensor = self.head(h)
        return out

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        # through forward (self(...)): fully_shard's hooks run on a module's __call__
        tokens = batch[0]
        loss = F.cross_entropy(self(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        self.print(f"batch {index}: loss {loss.item():.4f}")
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


torch.manual_seed(0)
tokens = torch.randint(0, 256, (64, 33))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
trainer = L.Trainer(
    accelerator="auto",
    devices=2,
    strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
    max_steps=4,
    accumulate_grad_batches=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
)
trainer.fit(LM(), loader)
fsdp_engine.restore_torch_fsdp()
trainer.print("ok")
