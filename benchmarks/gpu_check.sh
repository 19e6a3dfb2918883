#!/usr/bin/env bash
# The GPU check of issue 13, in one command on a machine with one CUDA GPU:
#
#   bash benchmarks/gpu_check.sh              # ~5 minutes on one GPU; results/gpu_check/summary.md
#   bash benchmarks/gpu_check.sh --dry        # the same steps on CPU/gloo, tiny (CI runs this)
#
# 1. training parity at world size 1 (NCCL): ours vs torch FSDP2, fp32 and bf16 mixed precision,
#    bitwise equal losses and final parameters (deterministic algorithms on);
# 2. memory: torch.cuda.memory_stats peaks and max_memory_reserved, ours vs FSDP2 (one process
#    per engine, so neither sees the other's cached blocks);
# 3. stream race: 100 steps of ours (bf16) as rank 0 of 4 on the fake process group (every stream
#    path runs: all-gather and reduce-scatter streams, prefetch, the cast; world size 1 issues no
#    collective) with CUDA_LAUNCH_BLOCKING=0 twice and =1 once: bitwise identical losses;
# 3b. the CUDA sanitizer (TORCH_CUDA_SANITIZER=1, torch.cuda._sanitizer): 5 steps of the race
#    run with every kernel's reads and writes checked against the streams' event order (an
#    unsynchronized access between streams raises); not run in --dry (CUDA only);
# 4. the fake-process-group host benchmark with CUDA tensors at m in {8, 1024} (real kernels and
#    streams, no communication; the fake backend runs the collectives).
# Exits non-zero if parity, the race check or the sanitizer fails. Options: --dry, --out DIR,
# --python PY.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
OUT=""
PY="${PYTHON:-python}"
DRY=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry) DRY=1 ;;
    --out) OUT="$2"; shift ;;
    --python) PY="$2"; shift ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry, --out DIR, --python PY)" >&2; exit 2 ;;
  esac
  shift
done

if [[ $DRY == 1 ]]; then
  OUT="${OUT:-${TMPDIR:-/tmp}/gpu_check_dry}"
  DEVICE=cpu; STEPS=3; RACE_STEPS=3; SIZE=(--layers 2 --dim 16 --hidden 32 --batch 4)
  HOST=(--worlds 8 64 --steps 2 --warmup 1 --layers 2)
else
  OUT="${OUT:-$ROOT/results/gpu_check}"
  DEVICE=cuda; STEPS=20; RACE_STEPS=100; SIZE=()
  HOST=(--worlds 8 1024 --steps 10)
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --dry')"
fi
mkdir -p "$OUT"
rm -f "$OUT"/parity_*.json "$OUT"/race_*.json "$OUT"/sanitizer.* "$OUT"/scale_host.* "$OUT"/summary.md
export CUBLAS_WORKSPACE_CONFIG=:4096:8   # deterministic cuBLAS (torch.use_deterministic_algorithms)
# One training run per line: engine, precision, steps, world (1: real; >1: fake process group),
# CUDA_LAUNCH_BLOCKING, output file.
runs() {
  for case in fp32 bf16; do
    for engine in ours fsdp2; do echo "$engine $case $STEPS 1 - $OUT/parity_${engine}_${case}.json"; done
  done
  echo "ours bf16 $RACE_STEPS 4 0 $OUT/race_a_async.json"
  echo "ours bf16 $RACE_STEPS 4 0 $OUT/race_b_async.json"
  echo "ours bf16 $RACE_STEPS 4 1 $OUT/race_c_blocking.json"
}

echo "== 1-3. parity and memory at world size 1, stream race ($DEVICE)"
if [[ $DRY == 1 ]]; then
  # every run in one process (no CUDA: nothing to isolate; saves a torch import per run)
  runs | "$PY" "$HERE/gpu_check.py" train-many --device "$DEVICE" "${SIZE[@]}"
else
  # one process per run: memory peaks of one engine only, and a fresh CUDA context per race run
  runs | while read -r engine case steps world blocking out; do
    mixed=(); [[ $case == bf16 ]] && mixed=(--mixed)
    envs=(); [[ $blocking != - ]] && envs=("CUDA_LAUNCH_BLOCKING=$blocking")
    env "${envs[@]}" "$PY" "$HERE/gpu_check.py" train --device "$DEVICE" "${SIZE[@]}" \
      --engine "$engine" --steps "$steps" --fake-world "$world" "${mixed[@]}" --out "$out" </dev/null
  done
fi

echo "== 3b. CUDA sanitizer"
if [[ $DRY == 1 ]]; then
  echo "not run (no CUDA in --dry)" > "$OUT/sanitizer.txt"
elif TORCH_CUDA_SANITIZER=1 "$PY" "$HERE/gpu_check.py" train --device cuda --engine ours \
    --steps 5 --fake-world 4 --mixed --out "$OUT/sanitizer.json" >"$OUT/sanitizer.log" 2>&1 </dev/null; then
  echo "passed (no unsynchronized access reported)" > "$OUT/sanitizer.txt"
else
  echo "FAILED (see sanitizer.log)" > "$OUT/sanitizer.txt"
fi

echo "== 4. host benchmark, fake process group, $DEVICE tensors"
"$PY" "$HERE/bench_scale_host.py" --device "$DEVICE" --collectives fake "${HOST[@]}" \
  --out "$OUT" --name scale_host

"$PY" "$HERE/gpu_check.py" report --out "$OUT"
