import torch
from torch import nn

import optim_blockwise as ob

model = nn.Sequential(nn.Embedding(100, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 100))
tokens = torch.randint(0, 100, (8, 32))

# 8-bit AdamW: ~2.03 bytes of state per parameter instead of 8.
opt = ob.AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.1, block_size=256)

# Muon for hidden matrices, AdamW for embeddings / head / norms / biases (per param group).
hidden = [model[1].weight, model[3].weight]
other = [model[0].weight, model[1].bias, model[3].bias]
muon = ob.Muon(
    [{"params": hidden}, {"params": other, "use_muon": False}],
    lr=3e-3,
    weight_decay=0.1,
    adjust_lr_fn="match_rms_adamw",  # Moonlight: reuse AdamW's lr
)

for optimizer in (opt, muon):
    for _ in range(3):
        loss = nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

# The block requirement each optimizer needs, as the engine's protocol (name, param) -> elements:
policy = ob.AdamW8bit.block_policy(block_size=256)
assert policy("w", model[1].weight) == 256  # a shard boundary never cuts a quant block
assert policy("bias", model[1].bias) == 1  # < 4096 elements: fp32 state, no constraint
assert policy("emb", torch.empty(100, 65)) == 4  # 25 blocks + a short one: gcd(6500, 256)
assert ob.Muon.block_policy()("w", model[1].weight) == 1  # the root gathers any flat ranges

# Give the engine and AdamW8bit the same policy: the optimizer takes its settings from it, and
# refuses at construction settings that disagree (shards would cut its quantization blocks).
sharded_opt = ob.AdamW8bit(model.parameters(), lr=1e-3, block_policy=policy)
assert (sharded_opt.block_size, sharded_opt.min_8bit_size) == (256, 4096)
try:
    ob.AdamW8bit(model.parameters(), block_policy=policy, min_8bit_size=256)
except ValueError as exc:
    assert "AdamW8bit(min_8bit_size=256) disagrees with its block_policy" in str(exc)
else:
    raise AssertionError("settings that disagree with the block policy must be refused")
