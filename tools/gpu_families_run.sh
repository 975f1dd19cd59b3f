#!/usr/bin/env bash
# Issue 29 item 6 for every VLM family on one H200, one call of at most 9 minutes: bench_e2e on each
# family's own model (planner/families.py; random weights, the LLM at LLM_LAYERS, default 4) under the
# one-GPU layout: qwen2_5_vl_7b (the baseline on this card: 11,376 tokens/s on 2026-11-26), internvl3_8b
# (12 tiles per sample), qwen3_vl_8b and qwen3_vl_30b_a3b (8 images of 224-1344 px per sample; the MoE's
# 128 experts fit one GPU only at a shrunk depth: ~85 GB planned at 4 layers, 550 GB at 48), then the
# table (tokens/s, TFLOPS/GPU, encoder FLOPs share, attention kernels) and one profiled step of PROFILE
# (default qwen3_vl_8b: the kernel families and costliest kernels).
# Out ($OUT, 5 files): hardware.txt, bench_e2e_families.jsonl, bench_e2e_families.log, table.md,
# profile_<PROFILE>.md.
#
# flash-attn-4: importable where $FA4_SITE is set (tools/gpu_env.sh; installed by tools/gpu_fa4_check.sh
# on this warm machine, its checked head dims used when there); otherwise every attention runs SDPA (the records
# name the kernels). Each run stops at 140 s (flash-attn-4 compiles its kernels in the first steps); no
# run starts after 380 s. The new presets run first, the baseline last.
# Usage: [LLM_LAYERS=4] [STEPS=3] [PROFILE=qwen3_vl_8b] [FA4_SITE=DIR] tools/gpu_families_run.sh
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
profile=${PROFILE:-qwen3_vl_8b}
e2e() {  # workload
  if [ $((SECONDS - start)) -gt 380 ]; then echo "$1: skipped (time)"; return; fi
  local extra=(); [ "$1" = "$profile" ] && extra=(--profile "$out/profile_$1.md")
  echo "== $(date +%T) $1" >> "$out/bench_e2e_families.log"
  timeout 140 torchrun --nproc-per-node 1 tools/bench_e2e.py --workload "$1" --llm-layers "${LLM_LAYERS:-4}" \
    --hetero-layout examples/layouts/single.yaml --warmup 2 --steps "${STEPS:-3}" \
    --out "$out/bench_e2e_families.jsonl" "${extra[@]}" >> "$out/bench_e2e_families.log" 2>&1
  echo "$1: exit $? at $((SECONDS - start)) s"
}
for workload in internvl3_8b qwen3_vl_8b qwen3_vl_30b_a3b qwen2_5_vl_7b; do e2e "$workload"; done
grep -E "^(attention|error)|Error|out of memory" "$out/bench_e2e_families.log" | sort | uniq -c | head -8
python3 tools/bench_e2e.py --report "$out/bench_e2e_families.jsonl" | tee "$out/table.md"
[ -f "$out/profile_$profile.md" ] && head -14 "$out/profile_$profile.md"
