#!/usr/bin/env bash
# Boundary figures on 2 GPUs (NCCL): bench_boundary against upstream and raw NCCL, then
# verify_layout on the 2-GPU example layouts. Run from the repo root; megatron-core from .whl/.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
torchrun --nproc-per-node 2 benchmarks/bench_boundary.py --sizes-mb 1 4 16 64 256 --iters 20 --warmup 5 \
  --dtype bf16 --json "$out/bench_boundary.json" 2>&1 | grep -v "^W11\|\*\*\*\*" | tee "$out/bench_boundary.log"
for layout in gpu2_colocated gpu2_colocated_cp2 gpu2_non_colocated; do
  echo "== verify_layout $layout"
  torchrun --nproc-per-node 2 tools/verify_layout.py examples/layouts/$layout.yaml --dtype bf16 \
    --hidden-size 4096 --tokens-per-image 1024 --images-per-sample 4 2 0 --iters 10 2>&1 \
    | grep -v "^W11\|\*\*\*\*" | tee -a "$out/verify_layout.log"
done
