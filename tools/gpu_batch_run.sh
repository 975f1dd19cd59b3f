#!/usr/bin/env bash
# Issue 30 on one H200, one call of at most 9 minutes: the whole step's MFU at the presets' own global
# batch. bench_e2e's default global batch of 4 (2 microbatches of 2) pays the optimizer step and the
# gradients' finalize once per 4 samples; W1 and W3 are defined at 16 (planner/presets.py), where the
# same per-step work spreads over 8 microbatches. W1 and W3 (8 LLM layers, flash-attn-4 where $FA4_SITE
# is set) at 4 then 16, alternating workloads, one profiled W1 step at 16 (profile_W1_gb16.md), then the
# medians (tools/ab_summary.py: the global batch is part of each variant). No run starts after 400 s.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
e2e() {  # workload, layout, global batch, warm-up steps, timed steps, extra bench_e2e arguments
  if [ $((SECONDS - start)) -gt 400 ]; then echo "$1 gb$3: skipped (time)"; return; fi
  timeout 150 torchrun --nproc-per-node 1 tools/bench_e2e.py --workload "$1" --llm-layers "${LLM_LAYERS:-8}" \
    --hetero-layout "examples/layouts/$2.yaml" --global-batch "$3" --micro-batch 2 --warmup "$4" --steps "$5" \
    --out "$out/bench_e2e.jsonl" "${@:6}" >> "$out/bench_e2e.log" 2>&1
  echo "$1 gb$3: exit $? at $((SECONDS - start)) s"
}
e2e W1 single 4 2 5; e2e W1 single 16 1 3 --profile "$out/profile_W1_gb16.md"
e2e W3 single_frozen 4 2 5; e2e W3 single_frozen 16 1 3
e2e W1 single 4 2 5; e2e W1 single 16 1 3
grep -E "^(attention|error)|Error" "$out/bench_e2e.log" | sort | uniq -c | head -8
python3 tools/ab_summary.py "$out/bench_e2e.jsonl" | tee "$out/summary.md"
[ -f "$out/profile_W1_gb16.md" ] && head -12 "$out/profile_W1_gb16.md"
