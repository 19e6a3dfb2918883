import shard_planner as sp

# One FSDP group: a fused expert weight cut only on 128-row blocks, a router, a norm.
specs = [
    sp.TensorSpec(numel=128 * 2880 * 5760, block=128 * 5760, name="experts.gate_up_proj"),
    sp.TensorSpec(numel=128 * 2880, block=2880, name="router.weight"),
    sp.TensorSpec(numel=2880, block=1, name="norm.weight"),
]
plan = sp.plan(specs, world_size=64, align=8)  # align: 16 bytes / 2-byte bf16 elements
plan.validate()  # re-checks every invariant

print(plan.shard_size, f"{100 * plan.padding_ratio:.3f}% padding")
assert plan.shard_size >= sp.lower_bound(specs, 64, 8)  # nothing can beat the bound
assert plan.shard_size <= sp.naive_plan(specs, 64, 8).shard_size

# What RaggedShard((0,), local_units) needs, with the 128-row block as the unit:
units = plan.local_units(0)
assert sum(units) == 2880 and len(units) == 64
# What rank 3 holds: (tensor, tensor-local range, shard-local range) triples.
for piece in plan.rank_slices(3):
    print(piece.tensor_index, piece.tensor_start, piece.tensor_stop, piece.shard_start)
# Ranks compare this before any collective (stable across processes and Python runs).
print(plan.fingerprint)
