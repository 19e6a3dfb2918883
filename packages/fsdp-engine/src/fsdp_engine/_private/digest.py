"""The frozen-values agreement's digest: one parameter's local bytes, hashed on its device."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from fsdp_engine._private import compat
from fsdp_engine._private.subclass import inner_tensors, plain_values

__all__ = ["value_digest"]

_DIGEST_CHUNK = 1 << 22  # words hashed per kernel: bounds the temporaries (~100 MiB at most)
# odd 64-bit multipliers of the two lanes (splitmix64's), wrapped into int64
_MIX = tuple(m - (1 << 64) if m >= 1 << 63 else m for m in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9))


def value_digest(param: torch.Tensor) -> str:
    """A digest of the local values' bytes, with the shape and dtype (a DTensor: its local
    shard, which the ranks of the data-parallel mesh hold identically), computed on the
    parameter's device: the bytes are read as 32-bit words ``w_i``, and each of two lanes sums
    ``(w_i xor (i * m)) * m`` with wrapping 64-bit integer arithmetic (exact and independent of
    the summation order, so every device and kernel gives the same value), chunk by chunk; only
    the two sums reach the host. Not cryptographic: it tells copies that differ apart (a
    difference anywhere, including swapped values, changes both lanes), which is its job."""
    local = compat.local_tensor(param) if isinstance(param, DTensor) else param
    try:
        parts = [plain_values(local)]
    except ValueError:  # a subclass with its own storage (NF4's codes and scales): all its bytes
        parts = inner_tensors(local)
    data_parts = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in parts]
    data = data_parts[0] if len(data_parts) == 1 else torch.cat(data_parts)
    pad = (-data.numel()) % 4
    if pad:
        data = torch.cat([data, data.new_zeros(pad)])
    words = data.view(torch.int32)
    lanes = torch.zeros(len(_MIX), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _DIGEST_CHUNK):
        chunk = words[start : start + _DIGEST_CHUNK].to(torch.int64)
        index = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device)
        for lane, mix in enumerate(_MIX):
            lanes[lane] += ((chunk ^ (index * mix)) * mix).sum()
    digest = "".join(f"{v & ((1 << 64) - 1):016x}" for v in lanes.tolist())
    return f"{tuple(param.shape)} {param.dtype} digest:{digest}"
