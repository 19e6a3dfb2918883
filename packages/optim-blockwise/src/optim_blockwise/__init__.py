"""Muon, blockwise 8-bit AdamW, Shampoo and SOAP that work natively on sharded parameters, and
torch's Adam(W) stepped on flat runs of parameters (``FlatAdamW``, ``FlatAdam``).

The optimizers are ordinary ``torch.optim.Optimizer``s that accept plain tensors, ``RaggedShard``
DTensors (ragged-dtensor) and torch FSDP2 ``Shard(0)`` DTensors, and give the single-device
result on sharded parameters (bit-identical for ``AdamW8bit``). Each exposes the block policy a
sharding engine needs (``(name, param) -> elements``) so that shards respect its blocks.
``FlatAdamW`` / ``FlatAdam`` are torch's own optimizers, bit for bit, run as one kernel set per
run of parameters that are views of one storage (a flat-buffer engine's shard).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from optim_blockwise._private.adamw8bit import AdamW8bit, adamw8bit_block_policy
from optim_blockwise._private.flat_adam import FlatAdam, FlatAdamW
from optim_blockwise._private.muon import Muon, muon_block_policy
from optim_blockwise._private.newton_schulz import (
    DEFAULT_NS_COEFFICIENTS,
    adjust_lr,
    assign_roots,
    newton_schulz,
    ns_flops,
    ns_root_bytes,
)
from optim_blockwise._private.owners import assign_owners
from optim_blockwise._private.policy import AdamW8bitBlockPolicy, MuonBlockPolicy
from optim_blockwise._private.quant import (
    block_absmax,
    dequantize_blockwise,
    dynamic_map,
    quantize_blockwise,
)
from optim_blockwise._private.roots import inverse_root
from optim_blockwise._private.shampoo import Shampoo
from optim_blockwise._private.soap import SOAP
from optim_blockwise._private.tiles import PreconditionerBlockPolicy


def _version() -> str:
    try:
        return version("optim-blockwise")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0.0.0+unknown"


__version__ = _version()

__all__ = [
    # optimizers
    "AdamW8bit",
    "Muon",
    "Shampoo",
    "SOAP",
    "FlatAdamW",
    "FlatAdam",
    # block policies (the engine's protocol: (name, param) -> elements)
    "AdamW8bitBlockPolicy",
    "MuonBlockPolicy",
    "PreconditionerBlockPolicy",
    "adamw8bit_block_policy",
    "muon_block_policy",
    # building blocks
    "DEFAULT_NS_COEFFICIENTS",
    "newton_schulz",
    "adjust_lr",
    "ns_flops",
    "ns_root_bytes",
    "assign_roots",
    "assign_owners",
    "inverse_root",
    "dynamic_map",
    "block_absmax",
    "quantize_blockwise",
    "dequantize_blockwise",
    "__version__",
]
