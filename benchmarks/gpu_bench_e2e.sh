#!/usr/bin/env bash
# bench_e2e on $GPUS GPUs (default 2): one workload under several layouts, then the table (the chart is drawn from
# the JSON lines afterwards: python benchmarks/bench_e2e.py --report FILE --png FILE).
# Usage: [GPUS=8] WORKLOAD=W1 LLM_LAYERS=8 EXTRA="--global-batch 24 --micro-batch 0" benchmarks/gpu_bench_e2e.sh [layout ...]
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
layouts=${*:-gpu2_homogeneous_tp2 gpu2_colocated gpu2_colocated_cp2 gpu2_non_colocated}
for layout in $layouts; do
  echo "== $(date +%T) torchrun --nproc-per-node "${GPUS:-2}" benchmarks/bench_e2e.py --workload ${WORKLOAD:-W1} --llm-layers ${LLM_LAYERS:-0} --hetero-layout examples/layouts/$layout.yaml"
  torchrun --nproc-per-node "${GPUS:-2}" benchmarks/bench_e2e.py --workload "${WORKLOAD:-W1}" --llm-layers "${LLM_LAYERS:-0}" ${EXTRA:-} \
    --hetero-layout "examples/layouts/$layout.yaml" --out "$out/bench_e2e.jsonl" >>"$out/bench_e2e.log" 2>&1 \
    || { echo "failed:"; grep -E "Error|error" "$out/bench_e2e.log" | tail -3; }
done
python3 benchmarks/bench_e2e.py --report "$out/bench_e2e.jsonl"
