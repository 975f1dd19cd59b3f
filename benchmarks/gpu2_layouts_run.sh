#!/usr/bin/env bash
# Layouts and boundaries on 2 GPUs (NCCL), about 9 minutes: the boundary against upstream's
# bridges and raw NCCL (bench_boundary, 1-256 MB), then W1 (LLM depth $LLM_LAYERS) through
# megatron.training under the 2-GPU layouts of examples/layouts (bench_e2e: $WARMUP warm-up steps,
# $STEPS timed one by one), then the MoE LLM under EP2. Records: $OUT/bench_e2e.jsonl (one line per
# run, with the step-time spread), bench_boundary.json, moe_*.jsonl; logs beside them.
# BENCH_ARGS: more bench_e2e options for every run (e.g. "--gpu-memory-gib 79.6": an H100's memory).
# Usage: [RUNS="W1:gpu2_colocated W1:gpu2_homogeneous_tp2:--use-distributed-optimizer"] benchmarks/gpu2_layouts_run.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LLM_LAYERS=${LLM_LAYERS:-8} WARMUP=${WARMUP:-2} STEPS=${STEPS:-10}
DISTOPT_RECOMPUTE="--use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
bench() {  # workload, layout, flags of the training script (may be empty), bench_e2e flags...
  local workload=$1 layout=$2 flags=$3; shift 3
  echo "== $(date +%T) $workload $layout [$flags] $*"
  timeout "${RUN_TIMEOUT:-150}" torchrun --nproc-per-node 2 benchmarks/bench_e2e.py --workload "$workload" \
    --llm-layers "$LLM_LAYERS" --warmup "$WARMUP" --steps "$STEPS" --hetero-layout "examples/layouts/$layout.yaml" \
    --flags="$flags" --out "$out/bench_e2e.jsonl" "$@" ${BENCH_ARGS:-} >>"$out/bench_e2e.log" 2>&1
  local rc=$?
  [ $rc = 0 ] || { echo "exit $rc:"; grep -E "^error|Error|out of memory" "$out/bench_e2e.log" | tail -2; }
}
if [ -z "${SKIP_BOUNDARY:-}" ]; then
  timeout 150 torchrun --nproc-per-node 2 benchmarks/bench_boundary.py --sizes-mb 1 4 16 64 256 --iters 20 --warmup 5 \
    --dtype bf16 --json "$out/bench_boundary.json" > "$out/bench_boundary.log" 2>&1; echo "bench_boundary: exit $?"
fi
if [ -n "${RUNS:-}" ]; then
  for run in $RUNS; do IFS=: read -r w l f <<<"$run"; bench "$w" "$l" "${f//,/ }"; done
else
  bench W1 gpu2_homogeneous_tp2 ""
  bench W1 gpu2_colocated ""
  bench W1 gpu2_colocated_cp2 ""
  bench W1 gpu2_non_colocated ""
  bench W1 gpu2_colocated_pp2 "" --colocated-schedule bubbles
  bench W1 gpu2_homogeneous_dp2 "$DISTOPT_RECOMPUTE"
  bench W1 gpu2_homogeneous_tp2 "--use-distributed-optimizer"
fi
python3 benchmarks/bench_e2e.py --report "$out/bench_e2e.jsonl"
[ -n "${SKIP_MOE:-}" ] || ONLY=moe_ep2_2gpu GPUS=2 bash benchmarks/gpu_moe_run.sh
