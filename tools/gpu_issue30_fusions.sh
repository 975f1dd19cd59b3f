#!/usr/bin/env bash
# Issue 30 item 2 on one H200, one call of at most 9 minutes: W1 and W3 end to end (bench_e2e, 8 LLM
# layers, through megatron.training) with the non-GEMM fusions off (A) and on (B: --hetero-fused-qkv-rope
# --hetero-fused-residual-norm), alternating A B A B on the same card (its clock drifts), then the medians
# (tools/ab_summary.py) and one profiled fused W1 step (kernel table and Chrome trace, tarred).
# Out ($OUT, 5 files): hardware.txt, bench_e2e.jsonl, bench_e2e.log, summary.md, profile_W1_fused.tar.gz.
#
# flash-attn-4: importable where $FA4_SITE is set (installed by tools/gpu_fa4_check.sh on this warm
# machine; its checked head dims, $FA4_SITE/checked_head_dims.txt, are used when there): both variants
# then run the same attention, which the records name. STEPS (default 5) timed steps per run, RUNS (2)
# pairs per workload; each run stops at 150 s, and no run starts after 480 s (the summary is written).
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${FA4_SITE:-}" ]; then
  export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  [ -f "$FA4_SITE/checked_head_dims.txt" ] && export MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS=$(cat "$FA4_SITE/checked_head_dims.txt")
fi
FUSED="--hetero-fused-qkv-rope --hetero-fused-residual-norm"
prof=/tmp/profile_W1_fused && rm -rf $prof && mkdir -p $prof
e2e() {  # workload, layout, fused (0/1), extra bench_e2e arguments
  if [ $((SECONDS - start)) -gt 480 ]; then echo "$1 fused=$3: skipped (time)"; return; fi
  local flags=""; [ "$3" = 1 ] && flags=$FUSED
  echo "== $(date +%T) $1 fused=$3" >> "$out/bench_e2e.log"
  timeout 150 torchrun --nproc-per-node 1 tools/bench_e2e.py --workload "$1" --llm-layers "${LLM_LAYERS:-8}" \
    --hetero-layout "examples/layouts/$2.yaml" --warmup 2 --steps "${STEPS:-5}" --out "$out/bench_e2e.jsonl" \
    --flags "$flags" "${@:4}" >> "$out/bench_e2e.log" 2>&1
  echo "$1 fused=$3: exit $? at $((SECONDS - start)) s"
}
for run in $(seq "${RUNS:-2}"); do
  extra=(); [ "$run" = 2 ] && extra=(--profile "$prof/profile_W1_fused.md" --profile-trace "$prof/trace_W1_fused.json")
  e2e W1 single 0; e2e W1 single 1 "${extra[@]}"
  e2e W3 single_frozen 0; e2e W3 single_frozen 1
done
grep -E "^(attention|error)|Error" "$out/bench_e2e.log" | sort | uniq -c | head -8
python3 tools/ab_summary.py "$out/bench_e2e.jsonl" | tee "$out/summary.md"
[ -f $prof/profile_W1_fused.md ] && head -12 $prof/profile_W1_fused.md | tee -a "$out/summary.md"
tar -czf "$out/profile_W1_fused.tar.gz" -C /tmp profile_W1_fused
if [ "$(stat -c %s "$out/profile_W1_fused.tar.gz")" -gt 15000000 ]; then  # $OUT returns files up to 16 MiB
  echo "the trace is too large to return: the kernel table only"; rm -f $prof/trace_W1_fused.json
  tar -czf "$out/profile_W1_fused.tar.gz" -C /tmp profile_W1_fused
fi
echo "done at $((SECONDS - start)) s"
