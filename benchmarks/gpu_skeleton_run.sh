#!/usr/bin/env bash
# The walking skeleton on 2 GPUs (NCCL): demo layout scaled to vision TP1/DP2 -> LLM TP2/DP1.
# Run from the repo root on a machine with torch; megatron-core comes from .whl/ if carried.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
python3 -c 'import torch, megatron.core; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)' | tee -a "$out/hardware.txt"
common=(@examples/demo_args.txt --hetero-layout examples/layouts/gpu2_colocated.yaml)
for run in fp32 bf16 ablate; do
  extra=(); [ $run = bf16 ] && extra=(--bf16); [ $run = ablate ] && extra=(--ablate-vision)
  echo "== $run: torchrun --nproc-per-node 2 examples/pretrain_vlm.py ${common[*]} ${extra[*]}"
  torchrun --nproc-per-node 2 examples/pretrain_vlm.py "${common[@]}" "${extra[@]}" \
    --metrics-file "/tmp/gpu2_$run.jsonl" 2>&1 | grep -v "Warning\|warn" | tee "$out/gpu2_$run.log" | grep -v "^ iteration" 
  grep "^ iteration" "$out/gpu2_$run.log" | sed -n '1p;$p'
done
