#!/usr/bin/env bash
# Every VLM family (its CPU-sized random model, the *_tiny presets) on GPUs under every layout kind:
# bench_e2e, $STEPS steps at micro batch 1 (bf16, NCCL) on 1 GPU and under 2-GPU layouts -- LLM TP
# without and with SP, CP, PP, the non-colocated placement, EP for the MoE -- two jobs at a time on
# GPUs 0-1 and 2-3; every step's loss against the 1-GPU run's (table.md). No job starts after
# BUDGET_S seconds. Out: hardware.txt, families.jsonl, families.log, table.md.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
FAMILIES=${FAMILIES:-"qwen2_5_vl_tiny qwen3_vl_tiny qwen3_vl_moe_tiny internvl_tiny"}
LAYOUTS=${LAYOUTS:-"gpu2_colocated gpu2_colocated_sp gpu2_colocated_cp2 gpu2_colocated_pp2 gpu2_non_colocated"}
job() {  # devices, port, workload, layout
  if [ $((SECONDS - start)) -gt "${BUDGET_S:-300}" ]; then echo "$3 $4: skipped (time)"; return; fi
  local n=$(( ${#1} / 2 + 1 ))
  CUDA_VISIBLE_DEVICES=$1 timeout -s KILL 120 torchrun --nproc-per-node $n --master-port "$2" benchmarks/bench_e2e.py \
    --workload "$3" --hetero-layout "examples/layouts/$4.yaml" --micro-batch 1 --warmup 0 --steps "${STEPS:-3}" \
    --out "$out/families.jsonl" > "/tmp/fam_$3_$4.log" 2>&1
  local rc=$?
  { echo "=== $3 $4: exit $rc"; tail -3 "/tmp/fam_$3_$4.log"; } >> "$out/families.log"
  [ $rc = 0 ] || echo "$3 $4: exit $rc: $(grep -E '^error|Error' "/tmp/fam_$3_$4.log" | tail -1 | cut -c1-240)"
}
worker() {  # devices, port, then workload:layout items
  local devices=$1 port=$2; shift 2
  for item in "$@"; do job "$devices" "$port" "${item%%:*}" "${item##*:}"; done
}
items=()
for f in $FAMILIES; do
  for l in $LAYOUTS $([ "$f" = qwen3_vl_moe_tiny ] && echo gpu2_moe_colocated_ep2); do items+=("$f:$l"); done
done
# The 1-GPU references first, one family per GPU, then the layouts split over the two pairs.
i=0; for f in $FAMILIES; do job "$i" $((29700 + i)) "$f" single & i=$((i + 1)); done; wait
half=$(( (${#items[@]} + 1) / 2 ))
worker 0,1 29650 "${items[@]:0:$half}" & worker 2,3 29660 "${items[@]:$half}" & wait
python3 - "$out/families.jsonl" > "$out/table.md" <<'PY'
import json, sys
records = [json.loads(line) for line in open(sys.argv[1])]
single = {r["workload"]: r["losses"] for r in records if r["layout"] == "single"}
print("| family | layout | GPUs | losses | largest relative difference from 1 GPU |\n| --- | --- | --- | --- | --- |")
for r in records:
    ref = single.get(r["workload"])
    worst = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref)) if ref else None
    print(f"| {r['workload']} | {r['layout']} | {r['gpus']} | {', '.join(f'{x:.5f}' for x in r['losses'])} | "
          f"{'-' if worst is None else f'{worst:.2e}'} |")
PY
cat "$out/table.md"
