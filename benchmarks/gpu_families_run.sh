#!/usr/bin/env bash
# Every VLM family on one H200, at most 9 minutes: bench_e2e on each
# family's own model (families/<name>/presets.json; random weights, the LLM at LLM_LAYERS, default 4) under the
# one-GPU layout: qwen2_5_vl_7b (the baseline on this card: 11,376 tokens/s on 2026-11-26), internvl3_8b
# (12 tiles per sample), qwen3_vl_8b and qwen3_vl_30b_a3b (8 images of 224-1344 px per sample; the MoE's
# 128 experts fit one GPU only at a shrunk depth: ~85 GB planned at 4 layers, 550 GB at 48), then the
# table (tokens/s, TFLOPS/GPU, encoder FLOPs share, attention kernels) and one profiled step of PROFILE
# (default qwen3_vl_8b: the kernel families and costliest kernels).
# Out ($OUT, 5 files): hardware.txt, bench_e2e_families.jsonl, bench_e2e_families.log, table.md,
# profile_<PROFILE>.md.
#
# flash-attn-4: importable where $FA4_SITE is set (benchmarks/gpu_env.sh; installed by benchmarks/gpu_fa4_check.sh
# on this warm machine, its checked head dims used when there); otherwise every attention runs SDPA (the records
# name the kernels). Each run stops at 140 s (flash-attn-4 compiles its kernels in the first steps); no
# run starts after BUDGET_S (380) s. The new presets run first, the baseline last.
# MLP_AB="qwen2_5_vl_7b": instead, those families' MLP A/B, A B A B (~110 s a run: one family a call),
# megatron-core's MLP (A: MEGATRON_HETERO_MLP_KERNEL=torch) against the default (B: the fused SwiGLU and
# GELU), records bench_e2e_A.jsonl / bench_e2e_B.jsonl, medians in ab_table.md (benchmarks/ab_summary.py).
# Usage: [LLM_LAYERS=4] [STEPS=3] [PROFILE=qwen3_vl_8b] [MLP_AB=...] [FA4_SITE=DIR] benchmarks/gpu_families_run.sh
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
profile=${PROFILE:-qwen3_vl_8b}
e2e() {  # workload [records file] [MLP kernel]
  if [ $((SECONDS - start)) -gt "${BUDGET_S:-380}" ]; then echo "$1: skipped (time)"; return; fi
  local extra=(); [ "$1" = "$profile" ] && [ -z "${MLP_AB:-}" ] && extra=(--profile "$out/profile_$1.md")
  echo "== $(date +%T) $1 ${3:-}" >> "$out/bench_e2e_families.log"
  MEGATRON_HETERO_MLP_KERNEL=${3:-${MEGATRON_HETERO_MLP_KERNEL:-auto}} timeout 140 torchrun --nproc-per-node 1 benchmarks/bench_e2e.py --workload "$1" \
    --llm-layers "${LLM_LAYERS:-4}" --hetero-layout examples/layouts/single.yaml --warmup 2 --steps "${STEPS:-3}" \
    --out "$out/${2:-bench_e2e_families.jsonl}" "${extra[@]}" >> "$out/bench_e2e_families.log" 2>&1
  echo "$1 ${3:-}: exit $? at $((SECONDS - start)) s"
}
if [ -n "${MLP_AB:-}" ]; then
  for round in 1 2; do
    for workload in $MLP_AB; do e2e "$workload" bench_e2e_A.jsonl torch; e2e "$workload" bench_e2e_B.jsonl auto; done
  done
  grep -E "^(mlp|error)|Error|out of memory" "$out/bench_e2e_families.log" | sort | uniq -c | head -8
  python3 benchmarks/ab_summary.py A="$out/bench_e2e_A.jsonl" B="$out/bench_e2e_B.jsonl" | tee "$out/ab_table.md"
  exit 0
fi
for workload in internvl3_8b qwen3_vl_8b qwen3_vl_30b_a3b qwen2_5_vl_7b; do e2e "$workload"; done
grep -E "^(attention|error)|Error|out of memory" "$out/bench_e2e_families.log" | sort | uniq -c | head -8
python3 benchmarks/bench_e2e.py --report "$out/bench_e2e_families.jsonl" | tee "$out/table.md"
[ -f "$out/profile_$profile.md" ] && head -14 "$out/profile_$profile.md"
