"""Accelerators and networks for the projection: public specs, each with its source named.

[Note: what is a spec and what is an assumption]
Capacities, peak dense BF16 throughput, HBM bandwidth and link rates below are the vendors'
published figures (the source document is named beside each). Two kinds of constants are *not*
specs and are marked as assumptions: how much of a link's rate a collective achieves
(``efficiency``, NCCL's bus bandwidth is typically 75-85% of the link rate in nccl-tests
reports) and the per-step latency ``alpha`` of a collective (nccl-tests small-message
latencies, a few microseconds per step within a node and around ten across nodes). Memory
capacities are GB as the vendors state them (10**9 bytes); ``reserved`` is the part a run can
never use (CUDA context, NCCL buffers, allocator fragmentation): an assumption too.

[Note: the collective model (alpha-beta)]
A ring all-gather over ``m`` ranks of ``S`` bytes per rank takes ``m - 1`` steps; in each every
rank forwards ``S`` bytes to its neighbour, so ``T = (m - 1) * (alpha + S / B)`` with ``B`` the
slowest link of the ring: NVLink when the ``m`` ranks share a node, the per-GPU network link
otherwise (every step of a ring spanning nodes waits on an inter-node hop). A reduce-scatter
moves the same bytes. An all-reduce of ``S`` bytes is a reduce-scatter plus an all-gather of
``S / m`` per rank: ``2 (m - 1) (alpha + S / (m B))``. At thousands of ranks the ``(m - 1) alpha``
term of a ring dominates; NCCL (2.23 and later) switches all-gather and reduce-scatter to PAT, a
log-depth schedule, there, so the latency term is ``min(m - 1, ceil(log2 m)) * alpha``-ish:
we take ``ceil(log2 m)`` steps of latency when ``m`` exceeds a node and ``m - 1`` within one.
"""

from __future__ import annotations

import math

import attrs

__all__ = ["GPUS", "Gpu", "NETWORKS", "Network", "collective_seconds"]

GB = 10**9


@attrs.frozen
class Gpu:
    """One accelerator model; every field but ``reserved`` is a published spec."""

    name: str
    memory_bytes: int  # HBM capacity
    hbm_bytes_per_s: float  # HBM bandwidth
    bf16_flops: float  # peak dense BF16 tensor throughput (no sparsity)
    nvlink_bytes_per_s: float  # NVLink bandwidth per GPU per direction
    source: str
    gpus_per_node: int = 8
    reserved: int = 4 * GB  # assumption: context, NCCL buffers, fragmentation

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - self.reserved


# Sources (vendor data sheets; BF16 figures are the dense values, half the "with sparsity" ones):
GPUS: dict[str, Gpu] = {
    "H100": Gpu(
        "H100",
        memory_bytes=80 * GB,
        hbm_bytes_per_s=3.35e12,
        bf16_flops=989e12,
        nvlink_bytes_per_s=450e9,  # 900 GB/s NVLink 4 total, both directions
        source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column",
    ),
    "H800": Gpu(
        "H800",
        memory_bytes=80 * GB,
        hbm_bytes_per_s=3.35e12,
        bf16_flops=989e12,
        nvlink_bytes_per_s=200e9,  # 400 GB/s NVLink total, both directions
        source="NVIDIA H800 Tensor Core GPU datasheet, H800 SXM5 column",
    ),
    "H200": Gpu(
        "H200",
        memory_bytes=141 * GB,
        hbm_bytes_per_s=4.8e12,
        bf16_flops=989e12,
        nvlink_bytes_per_s=450e9,  # 900 GB/s NVLink 4 total, both directions
        source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column",
    ),
    "B200": Gpu(
        "B200",
        memory_bytes=180 * GB,  # DGX B200: 1,440 GB HBM3e over 8 GPUs
        hbm_bytes_per_s=8e12,  # DGX B200: 64 TB/s over 8 GPUs
        bf16_flops=2.25e15,  # HGX B200: 18 PFLOPS dense FP16/BF16 over 8 GPUs
        nvlink_bytes_per_s=900e9,  # NVLink 5: 1.8 TB/s total, both directions
        source="NVIDIA DGX B200 datasheet and HGX B200 specifications (per-GPU = total / 8)",
    ),
}


@attrs.frozen
class Network:
    """Link rates (specs) and the alpha-beta constants of the collectives (assumptions)."""

    name: str
    inter_bytes_per_s: float  # per GPU, per direction, between nodes
    source: str
    efficiency: float = 0.8  # assumption: achieved bus bandwidth / link rate
    alpha_intra_s: float = 5e-6  # assumption: latency per ring step inside a node
    alpha_inter_s: float = 10e-6  # assumption: latency per step across nodes
    intra_bytes_per_s: float | None = None  # None: the GPU's NVLink


NETWORKS: dict[str, Network] = {
    # One 400 Gb/s NDR port per GPU (8 per node, rail-optimised), as in DGX H100/H200/B200.
    "ib400": Network(
        "ib400",
        inter_bytes_per_s=400e9 / 8,
        source="NVIDIA ConnectX-7 / Quantum-2 NDR InfiniBand: 400 Gb/s per port; DGX H100 "
        "user guide: 8 x 400 Gb/s compute-fabric ports, one per GPU",
    ),
}


def collective_seconds(
    op: str,
    ranks: int,
    per_rank_bytes: float,
    *,
    intra_node: bool,
    gpu: Gpu,
    network: Network,
) -> float:
    """Time of one collective under the alpha-beta model of the module Note.

    ``op``: ``"all_gather"`` / ``"reduce_scatter"`` (``per_rank_bytes`` = one rank's shard) or
    ``"all_reduce"`` (``per_rank_bytes`` = the whole buffer each rank holds).
    """
    m = ranks
    if m <= 1 or per_rank_bytes <= 0:
        return 0.0
    if intra_node:
        bandwidth = network.intra_bytes_per_s or gpu.nvlink_bytes_per_s
        alpha, steps = network.alpha_intra_s, m - 1
    else:
        bandwidth = network.inter_bytes_per_s
        alpha, steps = network.alpha_inter_s, min(m - 1, math.ceil(math.log2(m)))
    bandwidth *= network.efficiency
    if op in ("all_gather", "reduce_scatter"):
        return steps * alpha + (m - 1) * per_rank_bytes / bandwidth
    if op == "all_reduce":
        return 2 * steps * alpha + 2 * (m - 1) * per_rank_bytes / (m * bandwidth)
    raise ValueError(f"op must be all_gather, reduce_scatter or all_reduce, got {op!r}")
