#!/usr/bin/env bash
# The heterogeneous gain on 4 GPUs where the LLM must use model parallelism: a released model's shape
# at full LLM depth ($WORKLOAD, default qwen2_5_vl_7b: its 28 layers) at a long context ($SEQ tokens,
# $ITEMS images per sample: the preset's 224-1344 px images cycled), global batch $GB in microbatches
# of 1, under Megatron's homogeneous layouts (the encoder inheriting the LLM's TP, or replicated over
# its CP) and the heterogeneous ones (vision DP4), each with the recomputation the planner says fits
# (tools/plan_layout.py --layouts), all with the distributed optimizer, $STEPS timed steps after one
# warm-up. MEM80=1 on cards of more than 80 GB: each rank's allocator capped at $CAP_GIB (an H100's
# 79.6 GiB less what its process holds outside the allocator, recorded per run as
# outside_allocator_gib_max): an emulated 80 GB card.
# RUNS: "layout:recompute" items, recompute a number of layers (block), "full" or "0"; a run that
# runs out of memory is retried with RETRY_STEP more recomputed layers while time is left; no run
# starts after BUDGET_S seconds. Out: hardware.txt, bench_e2e.jsonl, bench_e2e.log, table.md.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
W=${WORKLOAD:-qwen2_5_vl_7b} SEQ=${SEQ:-32768} ITEMS=${ITEMS:-32} GB=${GB:-4} STEPS=${STEPS:-10}
RUNS=${RUNS:-"colocated_vdp4_ltp2cp2sp:26 gpu4_homogeneous_tp2cp2:full gpu4_homogeneous_tp4:26 gpu4_colocated_vdp4_ltp4sp:22"}
cap=()
if [ -n "${MEM80:-}" ] && python3 -c 'import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory <= 80 * 2**30)'; then
  cap=(--gpu-memory-gib "${CAP_GIB:-76}")
fi
recompute_flags() {  # full | 0 | N
  case $1 in
    0) echo "--use-distributed-optimizer" ;;
    full) echo "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1" ;;
    *) echo "--use-distributed-optimizer --recompute-granularity full --recompute-method block --recompute-num-layers $1" ;;
  esac
}
bench() {  # layout, recompute
  local layout=$1 recompute=$2
  if [ $((SECONDS - start)) -gt "${BUDGET_S:-420}" ]; then echo "$layout [$recompute]: skipped (time)"; return; fi
  echo "== $(date +%T) $layout recompute $recompute" | tee -a "$out/bench_e2e.log"
  timeout -s KILL "${RUN_TIMEOUT:-200}" torchrun --nproc-per-node 4 benchmarks/bench_e2e.py --workload "$W" --seq-length "$SEQ" \
    --items-per-sample "$ITEMS" --global-batch "$GB" --micro-batch 1 --warmup 1 --steps "$STEPS" \
    --hetero-layout "examples/layouts/$layout.yaml" --flags="$(recompute_flags "$recompute")" --out "$out/bench_e2e.jsonl" \
    "${cap[@]}" ${BENCH_ARGS:-} >> "$out/bench_e2e.log" 2>&1
  local rc=$?
  pkill -9 -f benchmarks/bench_e2e.py 2>/dev/null; sleep 2
  [ $rc = 0 ] && { echo "ran in $((SECONDS - start)) s"; return; }
  echo "exit $rc: $(grep -E '^error|out of memory' "$out/bench_e2e.log" | tail -1 | cut -c1-300)"
  if [ "$recompute" != full ] && grep -q "out of memory" <(tail -50 "$out/bench_e2e.log"); then
    local more=$((recompute + ${RETRY_STEP:-2}))
    [ $more -ge "${LLM_LAYERS_FULL:-28}" ] && more=full
    bench "$layout" "$more"
  fi
}
for run in $RUNS; do bench "${run%%:*}" "${run##*:}"; done
python3 benchmarks/bench_e2e.py --report "$out/bench_e2e.jsonl" > "$out/table.md" 2>&1; cat "$out/table.md"
