import torch
from torch import nn
from torch.distributed.tensor import init_device_mesh

from fsdp_engine import MixedPrecisionPolicy, QuantizedAllGather, QuantizedWeight, fully_shard
from ragged_dtensor.testing import run_processes


def train(rank: int, world: int) -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 128))
    seen: dict[str, QuantizedWeight] = {}
    policy = QuantizedAllGather(
        "float8_e4m3fn",
        block=(128, 128),  # one fp32 scale per 128x128 tile (DeepSeek-V3's weight format)
        hook=lambda w: seen.__setitem__(w.name, w),  # FP8 codes and scales, for FP8 GEMMs
    )
    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32, quantized_all_gather=policy)
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)), mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(rank))
    model(x).float().pow(2).mean().backward()  # one all-gather of codes + scales per unshard
    opt.step()  # the fp32 master shards: no code ever reaches the optimizer or a checkpoint
    model.unshard()
    weight = seen["0.weight"]  # the codes and scales of the last all-gather
    exact = weight.codes.dtype == torch.float8_e4m3fn and torch.equal(
        model[0].weight.detach(), weight.dequantize(torch.bfloat16)
    )
    model.reshard()
    return exact and sorted(seen) == ["0.weight", "2.weight"]  # biases travel in bf16


if __name__ == "__main__":
    assert run_processes(train, 2) == [True, True]
    print("ok")
