import shard_planner.projection as proj

model = proj.catalogue_model("gpt-oss-120b")
setup = proj.Setup(seq=4096, micro_batch=1, reduce_bytes=2)  # bf16 reduction
gpu = proj.GPUS["H800"]
fits = {}
for m in (128, 256):
    p = proj.project(model, m, gpu, setup)
    print(m, f"ours {p.ours.peak_bytes / 1e9:.1f} GB", f"FSDP2 {p.fsdp2.peak_bytes / 1e9:.1f} GB")
    print("  ours at the peak:", dict(p.ours.breakdown), p.ours.peak_at)
    fits[m] = (p.ours.peak_bytes <= gpu.usable_bytes, p.fsdp2.peak_bytes <= gpu.usable_bytes)
assert fits == {128: (True, True), 256: (True, False)}  # the paper's finding

advice = proj.advise(
    proj.catalogue_model("llama3-70b"),
    16384,
    proj.GPUS["H100"],
    proj.Setup(block_rows=16, activation_checkpointing=True),
)
print(advice.mesh_shape, advice.chosen.layers_per_group)  # (replicate, shard), layers/group
assert advice.mesh_shape[0] * advice.mesh_shape[1] == 16384
