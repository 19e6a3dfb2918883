#!/usr/bin/env bash
# The GPU check (issues 13 and 25), one command on a machine with one or more CUDA GPUs:
#
#   bash benchmarks/gpu_check.sh                 # every part; results/gpu_check/summary.md
#   bash benchmarks/gpu_check.sh --dry           # every part tiny on CPU/gloo (CI runs this)
#   bash benchmarks/gpu_check.sh --dry --separate  # the same, one launch per run as on GPUs
#
# Parts (--only a,b,...; default all, in this order):
#   parity     world size 1 (NCCL): ours vs torch FSDP2, fp32 and bf16 mixed precision, bitwise
#              equal losses and final parameters (deterministic algorithms); their
#              torch.cuda.memory_stats peaks;
#   race       100 steps of ours (bf16) as rank 0 of 4 on the fake process group (every stream
#              path runs) with CUDA_LAUNCH_BLOCKING=0 twice and =1 once: bitwise identical;
#   stress     the stronger race check: a larger MLP (dim 1024, hidden 4096, 8 layers), a sleep
#              kernel of random length on the communication stream before every collective
#              (dbuffer's streams.before_collective) and on the compute stream around every
#              block, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True with empty_cache() every
#              step, fp32 and bf16. On N >= 2 GPUs: torchrun, N ranks on NCCL, against a
#              one-process reference (bitwise at N = 2, within a stated tolerance above); on
#              one GPU: rank 0 of 4 on the fake process group against a serial run
#              (CUDA_LAUNCH_BLOCKING=1, no sleeps), bitwise. Beside those, bf16 with HSDP (2
#              replicas x N/2 shards: the all-reduce stream), user collectives
#              (set_custom_all_gather / set_custom_reduce_scatter) and in-place gradients
#              (zero_grad(set_to_none=False)): on N >= 2 even GPUs N ranks, on one GPU rank 0 of
#              4 on the fake process group (2 x 2: every stream's collective); the report fails
#              a run whose hook saw no collective of a kind its mesh issues; and float8 (the
#              FP8 quantized all-gather, 1 x 8 tiles) on N >= 2 GPUs against a reference that
#              quantizes the whole weights (on one GPU there is no float8 case: the fake
#              group's receive buffers are never filled);
#   bench      ours vs FSDP2 on a LLaMA-like model (bf16 mixed precision, AdamW), each run its
#              own launch, alternating (ours, FSDP2, ours, FSDP2, ...; --runs per engine):
#              step-time ratio (median of the runs' medians, and of the minimums),
#              max_memory_allocated and max_memory_reserved ratios; our losses against FSDP2's
#              of the same command (bitwise or within the precision's tolerance, else the
#              report fails: a fast wrong run never passes; not comparable on the fake group). On N >= 2 GPUs: torchrun,
#              N ranks on NCCL, with TORCH_NCCL_AVOID_RECORD_STREAMS unset and =1; on one GPU:
#              world size 1 on NCCL (unset and =1) and rank 0 of 8 on the fake process group;
#   sanitizer  5 steps of the race run under TORCH_CUDA_SANITIZER=1 (not in --dry);
#   host       the fake-process-group host benchmark with device tensors at m in {8, 1024}.
#
# Options: --dry; --separate (with --dry: each run its own launch, as on GPUs; slower); --out DIR (default results/gpu_check; --dry: $TMPDIR/gpu_check_dry);
# --python PY (default $PYTHON or python); --gpus N (default: every visible GPU; --dry: 2 gloo
# ranks); --runs R (bench runs per engine and configuration; default 3, --dry 2); --avoid-record-
# streams both|unset|1 (default both); --budget S (seconds for all launches, default 450: the
# command ends within about S + 30 s, a launch that would start later is skipped and reported);
# --archive FILE (a .tgz of the out folder at the end).
#
# Every launch runs under `timeout` (and stops itself 10 s earlier with its stacks dumped; process
# groups time out too), its output in OUT/logs/NAME.log, its exit status in OUT/launches.tsv;
# a failed launch does not stop the others. The report (gpu_check.py report) writes
# OUT/summary.md, OUT/gpu_bench.md and OUT/gpu_check.json (benchmarks/readme_tables.py renders
# the README's GPU section from it). Exit status: 0 passed, 1 a part failed, timed out, was
# skipped or is missing, 2 the preflight failed (no CUDA, or the packages do not import).
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
OUT=""
PY="${PYTHON:-python}"
DRY=0
SEPARATE=0
GPUS=""
ONLY="all"
RUNS=""
AVOID="both"
BUDGET=""
ARCHIVE=""
ALL_PARTS=(parity race stress bench sanitizer host)
usage="use --dry, --separate, --out DIR, --python PY, --gpus N, --only PART,..., --runs R, \
--avoid-record-streams both|unset|1, --budget S, --archive FILE (parts: ${ALL_PARTS[*]})"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry) DRY=1 ;;
    --separate) SEPARATE=1 ;;
    --out) OUT="$2"; shift ;;
    --python) PY="$2"; shift ;;
    --gpus) GPUS="$2"; shift ;;
    --only) ONLY="$2"; shift ;;
    --runs) RUNS="$2"; shift ;;
    --avoid-record-streams) AVOID="$2"; shift ;;
    --budget) BUDGET="$2"; shift ;;
    --archive) ARCHIVE="$2"; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 ($usage)" >&2; exit 2 ;;
  esac
  shift
done
if [[ $ONLY == all ]]; then PARTS=("${ALL_PARTS[@]}"); else IFS=, read -r -a PARTS <<<"$ONLY"; fi
for part in "${PARTS[@]}"; do
  [[ " ${ALL_PARTS[*]} " == *" $part "* ]] || { echo "gpu_check.sh: unknown part $part ($usage)" >&2; exit 2; }
done
case "$AVOID" in both) AVOIDS=(unset 1) ;; unset) AVOIDS=(unset) ;; 1) AVOIDS=(1) ;;
  *) echo "gpu_check.sh: --avoid-record-streams $AVOID ($usage)" >&2; exit 2 ;; esac
has() { [[ " ${PARTS[*]} " == *" $1 "* ]]; }

# The packages of this checkout, installed or not (a GPU machine's own python and torch).
for pkg in ragged-dtensor shard-planner dbuffer fsdp-engine optim-blockwise; do
  PYTHONPATH="$ROOT/packages/$pkg/src${PYTHONPATH:+:$PYTHONPATH}"
done
export PYTHONPATH PYTHONUNBUFFERED=1
export CUBLAS_WORKSPACE_CONFIG=:4096:8   # deterministic cuBLAS (torch.use_deterministic_algorithms)
unset TORCH_NCCL_AVOID_RECORD_STREAMS CUDA_LAUNCH_BLOCKING PYTORCH_CUDA_ALLOC_CONF
ALLOC=PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True

if [[ $DRY == 1 ]]; then
  OUT="${OUT:-${TMPDIR:-/tmp}/gpu_check_dry}"
  DEVICE=cpu; STEPS=3; RACE_STEPS=3; SIZE=(--layers 2 --dim 16 --hidden 32 --batch 4)
  STRESS=(--device cpu --layers 2 --dim 16 --hidden 32 --batch 4 --steps 4 --host-sleep 0.002)
  BENCH=(--device cpu --mixed --dim 32 --layers 2 --heads 4 --ffn 64 --vocab 64 --seq 16
         --batch 2 --warmup 1 --steps 2)
  HOST=(--worlds 8 64 --steps 2 --warmup 1 --layers 2)
  GPUS="${GPUS:-2}"; RUNS="${RUNS:-2}"; BUDGET="${BUDGET:-600}"
else
  OUT="${OUT:-$ROOT/results/gpu_check}"
  DEVICE=cuda; STEPS=20; RACE_STEPS=100; SIZE=()
  STRESS=(--device cuda); BENCH=(--device cuda --mixed)
  HOST=(--worlds 8 1024 --steps 10)
  RUNS="${RUNS:-3}"; BUDGET="${BUDGET:-450}"
fi
mkdir -p "$OUT/logs"
rm -f "$OUT"/{parity,race,stress,bench}_*.json "$OUT"/{preflight,gpu_check}.json "$OUT"/sanitizer.* \
  "$OUT"/scale_host.* "$OUT"/{summary,gpu_bench}.md "$OUT"/runs_*.txt "$OUT"/logs/*.log
: > "$OUT/launches.tsv"
DEADLINE=$((SECONDS + BUDGET))

launch() {  # launch NAME LIMIT CMD...: under a time limit, logged, its exit status recorded
  local name=$1 limit=$2 left=$((DEADLINE - SECONDS)) start=$SECONDS rc=0
  shift 2
  if ((left < 20)); then
    printf '%s\tskipped\t0\t%s\n' "$name" "$limit" >>"$OUT/launches.tsv"
    echo "  $name: skipped (the --budget of $BUDGET s is spent)"
    return 0
  fi
  ((limit > left)) && limit=$left
  GPU_CHECK_DEADLINE_S=$limit timeout --kill-after=15 "$limit" "$@" >"$OUT/logs/$name.log" 2>&1 \
    </dev/null || rc=$?
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" "$limit" >>"$OUT/launches.tsv"
  if ((rc == 0)); then
    echo "  $name: ok ($((SECONDS - start)) s)"
  else
    echo "  $name: FAILED (exit $rc after $((SECONDS - start)) s of $limit; $OUT/logs/$name.log)"
    tail -n 8 "$OUT/logs/$name.log" | sed 's/^/    /'
  fi
}

echo "== preflight ($DEVICE)"
if [[ $DRY == 0 ]]; then
  launch preflight 180 "$PY" "$HERE/gpu_check.py" preflight --require-cuda --out "$OUT"
  if ! grep -q '^gpu_count=' "$OUT/logs/preflight.log"; then
    cat "$OUT/logs/preflight.log" >&2
    echo "gpu_check.sh: the preflight failed (no CUDA device, or the packages do not import)" >&2
    exit 2
  fi
  found=$(sed -n 's/^gpu_count=//p' "$OUT/logs/preflight.log")
  GPUS="${GPUS:-$found}"
  if ((GPUS < 1 || GPUS > found)); then
    echo "gpu_check.sh: --gpus $GPUS, but $found visible" >&2
    exit 2
  fi
fi
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$GPUS" --max-restarts 0)
echo "== $GPUS $([[ $DRY == 1 ]] && echo 'gloo ranks (dry)' || echo GPUs); parts: ${PARTS[*]}; \
budget $BUDGET s; out $OUT"

# job NAME LIMIT single|ranks [VAR=value ...] SUBCOMMAND ARGS...: one run of gpu_check.py, in
# its own launch (one process, or torchrun over the GPUs); with --dry appended to one of two
# lists that run in one process each (no CUDA: nothing to isolate, one torch import per list;
# --separate launches each as on GPUs).
job() {
  local name=$1 limit=$2 mode=$3 line envs=()
  shift 3
  while [[ $# -gt 0 && $1 == *=* && $1 != -* ]]; do envs+=("$1"); shift; done
  if [[ $DRY == 1 && $SEPARATE == 0 ]]; then
    printf -v line '%q ' "${envs[@]}" "$@"
    echo "$line" >>"$OUT/runs_$mode.txt"
  elif [[ $mode == ranks ]]; then
    launch "$name" "$limit" env "${envs[@]}" "${TORCHRUN[@]}" "$HERE/gpu_check.py" "$@"
  else
    launch "$name" "$limit" env "${envs[@]}" "$PY" "$HERE/gpu_check.py" "$@"
  fi
}
rm -f "$OUT/runs_single.txt" "$OUT/runs_ranks.txt"
[[ $DRY == 1 ]] && job preflight 60 single preflight --out "$OUT"

if has parity; then
  echo "== parity and memory at world size 1"
  for case in fp32 bf16; do
    mixed=(); [[ $case == bf16 ]] && mixed=(--mixed)
    for engine in ours fsdp2; do
      job "parity_${engine}_$case" 180 single train --device "$DEVICE" "${SIZE[@]}" \
        --engine "$engine" --steps "$STEPS" --fake-world 1 "${mixed[@]}" \
        --out "$OUT/parity_${engine}_$case.json"
    done
  done
fi

if has race; then
  echo "== stream race, rank 0 of 4 on the fake process group"
  for run in a_async:0 b_async:0 c_blocking:1; do
    job "race_${run%:*}" 240 single "CUDA_LAUNCH_BLOCKING=${run#*:}" train --device "$DEVICE" \
      "${SIZE[@]}" --engine ours --mixed --steps "$RACE_STEPS" --fake-world 4 \
      --out "$OUT/race_${run%:*}.json"
  done
fi

if has stress; then
  echo "== stress race check (sleeps, expandable segments, empty_cache every step)"
  for case in fp32 bf16; do
    mixed=(); [[ $case == bf16 ]] && mixed=(--mixed)
    if ((GPUS >= 2)); then
      job "stress_ranks${GPUS}_$case" 300 ranks "$ALLOC" stress "${STRESS[@]}" "${mixed[@]}" \
        --out "$OUT/stress_ranks${GPUS}_$case.json"
    fi
    if ((GPUS == 1)) || [[ $DRY == 1 ]]; then  # --dry takes both paths
      job "stress_fake4_${case}_serial" 300 single CUDA_LAUNCH_BLOCKING=1 stress \
        "${STRESS[@]}" "${mixed[@]}" --fake-world 4 --serial \
        --out "$OUT/stress_fake4_${case}_serial.json"
      job "stress_fake4_$case" 300 single "$ALLOC" stress "${STRESS[@]}" "${mixed[@]}" \
        --fake-world 4 --out "$OUT/stress_fake4_$case.json"
    fi
  done
  # HSDP (the all-reduce stream), user collectives and in-place gradients, bf16
  VARIANT=(--hsdp --custom-collectives --inplace-grads)
  if ((GPUS >= 2 && GPUS % 2 == 0)); then
    job "stress_ranks${GPUS}_hsdp_bf16" 300 ranks "$ALLOC" stress "${STRESS[@]}" --mixed \
      "${VARIANT[@]}" --out "$OUT/stress_ranks${GPUS}_hsdp_bf16.json"
  fi
  if ((GPUS >= 2)); then  # float8 (the FP8 quantized all-gather): real ranks only (the fake
    # group's unfilled receive buffers are NaN scales; on one GPU there is no float8 case)
    job "stress_ranks${GPUS}_float8_bf16" 300 ranks "$ALLOC" stress "${STRESS[@]}" --mixed \
      --float8 --out "$OUT/stress_ranks${GPUS}_float8_bf16.json"
  fi
  if ((GPUS == 1)) || [[ $DRY == 1 ]]; then
    job "stress_fake4_hsdp_bf16_serial" 300 single CUDA_LAUNCH_BLOCKING=1 stress \
      "${STRESS[@]}" --mixed "${VARIANT[@]}" --fake-world 4 --serial \
      --out "$OUT/stress_fake4_hsdp_bf16_serial.json"
    job "stress_fake4_hsdp_bf16" 300 single "$ALLOC" stress "${STRESS[@]}" --mixed \
      "${VARIANT[@]}" --fake-world 4 --out "$OUT/stress_fake4_hsdp_bf16.json"
  fi
fi

if has bench; then
  echo "== ours vs FSDP2, alternating launches, $RUNS runs each"
  configs=()  # label:mode:fake world:TORCH_NCCL_AVOID_RECORD_STREAMS
  if ((GPUS >= 2)); then
    for avoid in "${AVOIDS[@]}"; do configs+=("ranks$GPUS-avoid-$avoid:ranks:1:$avoid"); done
    ((GPUS % 2 == 0)) && configs+=("ranks$GPUS-hsdp:ranks:1:unset:--hsdp")  # 2 x N/2 mesh
  fi
  if ((GPUS == 1)) || [[ $DRY == 1 ]]; then
    for avoid in "${AVOIDS[@]}"; do
      [[ $DRY == 1 && $avoid != unset ]] && continue  # gloo: nothing to vary
      configs+=("world1-avoid-$avoid:single:1:$avoid")
    done
    configs+=("fake8:single:8:unset")
  fi
  for config in "${configs[@]}"; do
    IFS=: read -r label mode fake avoid extra <<<"$config"
    envs=(); [[ $avoid != unset ]] && envs=("TORCH_NCCL_AVOID_RECORD_STREAMS=$avoid")
    extras=(); [[ -n ${extra:-} ]] && extras=("$extra")
    for ((run = 1; run <= RUNS; run++)); do
      for engine in ours fsdp2; do
        job "bench_${label}_${engine}_$run" 180 "$mode" "${envs[@]}" bench "${BENCH[@]}" \
          --engine "$engine" --config "$label" --index "$run" --fake-world "$fake" \
          "${extras[@]}" --out "$OUT/bench_${label}_${engine}_$run.json"
      done
    done
  done
fi

if has sanitizer; then
  echo "== CUDA sanitizer"
  if [[ $DRY == 1 ]]; then
    echo "not run (no CUDA in --dry)" >"$OUT/sanitizer.txt"
  else
    launch sanitizer 300 env TORCH_CUDA_SANITIZER=1 "$PY" "$HERE/gpu_check.py" train \
      --device cuda --engine ours --steps 5 --fake-world 4 --mixed --out "$OUT/sanitizer.json"
    case "$(tail -n 1 "$OUT/launches.tsv" | cut -f2)" in
      0) echo "passed (no unsynchronized access reported)" >"$OUT/sanitizer.txt" ;;
      skipped) echo "not run (the time budget was spent)" >"$OUT/sanitizer.txt" ;;
      *) echo "FAILED (see sanitizer.log)" >"$OUT/sanitizer.txt"
         cp "$OUT/logs/sanitizer.log" "$OUT/sanitizer.log" ;;
    esac
  fi
fi

if has host; then
  echo "== host benchmark, fake process group, $DEVICE tensors"
  job host 300 single host --device "$DEVICE" --collectives fake "${HOST[@]}" --out "$OUT" \
    --name scale_host
fi

if [[ $DRY == 1 && $SEPARATE == 0 ]]; then
  echo "== the runs above: one process, and beside it one torchrun launch of $GPUS gloo ranks"
  if [[ -s $OUT/runs_ranks.txt ]]; then
    launch runs_ranks 600 "${TORCHRUN[@]}" "$HERE/gpu_check.py" many --file "$OUT/runs_ranks.txt" &
  fi
  launch runs_single 600 "$PY" "$HERE/gpu_check.py" many --file "$OUT/runs_single.txt"
  wait
fi

echo "== report"
dry=(); [[ $DRY == 1 ]] && dry=(--dry)
parts="${PARTS[*]}"
rc=0
timeout 120 "$PY" "$HERE/gpu_check.py" report --out "$OUT" --parts "${parts// /,}" "${dry[@]}" \
  || rc=$?
if [[ -n $ARCHIVE ]]; then
  tar -czf "$ARCHIVE" -C "$(dirname "$OUT")" "$(basename "$OUT")" && echo "archive: $ARCHIVE"
fi
exit $rc
