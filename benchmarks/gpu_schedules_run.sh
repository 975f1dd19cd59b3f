#!/usr/bin/env bash
# The demo model on 2 GPUs (NCCL) under the schedules: non-colocated (vision on GPU 0, LLM on GPU 1,
# 1F1B over 4 microbatches a step), colocated with LLM CP2, colocated with LLM PP2 (under each
# --hetero-colocated-schedule), and two encoders colocated; per run the last log lines: tokens/s, the waiting share per rank, the caption accuracy.
# Usage: [ONLY="non_colocated colocated_cp2"] [EXTRA="--train-iters 300"] benchmarks/gpu_schedules_run.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
run() {  # name, layout, extra flags
  local name=$1 layout=$2; shift 2
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return
  echo "== $name: torchrun --nproc-per-node 2 examples/pretrain_vlm.py @examples/demo_args.txt --hetero-layout examples/layouts/$layout.yaml --log-interval 100 $* ${EXTRA:-}"
  torchrun --nproc-per-node 2 examples/pretrain_vlm.py @examples/demo_args.txt --log-interval 100 \
    --hetero-layout examples/layouts/$layout.yaml --metrics-file "/tmp/$name.jsonl" "$@" ${EXTRA:-} 2>&1 \
    | grep -v "Warning\|warn\|DEPRECATED\|^W1\|OMP_NUM" | tee "$out/train_$name.log" | grep -v "^ iteration\|^rank\|^vision\|^llm\|^audio\|^edges"
  grep "^ iteration" "$out/train_$name.log" | tail -1
  python3 - "/tmp/$name.jsonl" <<'PY'
import json, statistics, sys
steps = [json.loads(line) for line in open(sys.argv[1]) if '"step"' in line][10:]  # after warm-up
ms = statistics.median(1000 * (b["elapsed_s"] - a["elapsed_s"]) for a, b in zip(steps, steps[1:]))
print(f"   steps 11-{len(steps) + 10}, median: {statistics.median(s['tokens_per_s'] for s in steps):.0f} tokens/s, "
      f"{ms:.1f} ms/step, rank-0 waiting share {100 * statistics.median(s['waiting_share'] for s in steps):.1f}%")
PY
}
run non_colocated gpu2_non_colocated
run colocated_cp2 gpu2_colocated_cp2
run colocated_pp2 gpu2_colocated_pp2
run colocated_pp2_three_phase gpu2_colocated_pp2 --hetero-colocated-schedule three-phase
run colocated_pp2_bubbles gpu2_colocated_pp2 --hetero-colocated-schedule bubbles
run colocated_two_encoders gpu2_colocated_two_encoders --seq-length 40
run non_colocated_bf16 gpu2_non_colocated --bf16
run colocated_cp2_bf16 gpu2_colocated_cp2 --bf16
