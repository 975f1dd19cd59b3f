#!/usr/bin/env bash
# The demo model, non-colocated on 2 GPUs (NCCL): vision on GPU 0, LLM on GPU 1, 4 microbatches a
# step through the two-stage pipeline; then the colocated demo layout again, for comparison.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
for layout in gpu2_non_colocated gpu2_colocated; do
  echo "== $layout: torchrun --nproc-per-node 2 examples/pretrain_vlm.py @examples/demo_args.txt --hetero-layout examples/layouts/$layout.yaml"
  torchrun --nproc-per-node 2 examples/pretrain_vlm.py @examples/demo_args.txt \
    --hetero-layout examples/layouts/$layout.yaml --metrics-file "/tmp/$layout.jsonl" 2>&1 \
    | grep -v "Warning\|warn" | tee "$out/train_$layout.log" | grep -v "^ iteration"
  grep "^ iteration" "$out/train_$layout.log" | sed -n '1p;$p'
done
