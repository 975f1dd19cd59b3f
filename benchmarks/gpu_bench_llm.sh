#!/usr/bin/env bash
# bench_llm on 2 GPUs: the LLM alone under several variants (one per argument, quoted), then the
# JSON lines. Usage: benchmarks/gpu_bench_llm.sh "--spec local --tp 2" "--spec ours --tp 2 --seq 16384 --micro 2" ...
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
for variant in "$@"; do
  echo "== $(date +%T) torchrun --nproc-per-node 2 benchmarks/bench_llm.py $variant"
  # shellcheck disable=SC2086
  torchrun --nproc-per-node 2 benchmarks/bench_llm.py $variant --out "$out/bench_llm.jsonl" \
    >>"$out/bench_llm.log" 2>&1 || { echo "failed:"; grep -E "Error|error" "$out/bench_llm.log" | tail -3; }
  tail -1 "$out/bench_llm.jsonl" 2>/dev/null
done
