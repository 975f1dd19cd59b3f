#!/usr/bin/env bash
# Two GPU-only checks on 2 GPUs (H100 80GB; about 6 minutes), with this checkout
# installed as users install it (gpu_env.sh: install_checkout).
# 1. CUDA_DEVICE_MAX_CONNECTIONS unset, LLM TP2 (colocated vision DP2 -> LLM TP2), the example through
#    torchrun without the launcher: expect "megatron-hetero: set CUDA_DEVICE_MAX_CONNECTIONS=1, ..." once
#    and 5 iterations (before the fix: Megatron's argument check stopped every rank).
# 2. bench_e2e W1 (8 LLM layers) under homogeneous DP2 on 80 GB cards: out of memory. Expect exactly one
#    "error: rank N stopped in ... out of GPU memory in module M's <phase> (peak ... GiB allocated of the
#    GPU's ... GiB; ...); to use less memory: ..." line per rank (the other rank's ends "(reported by
#    rank N)"), the planner's best W1 layout among the advice, and no traceback.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
env -u CUDA_DEVICE_MAX_CONNECTIONS timeout 300 torchrun --nproc-per-node 2 examples/pretrain_vlm.py @examples/demo_args.txt \
  --hetero-layout examples/layouts/gpu2_colocated.yaml --bf16 --train-iters 5 --eval-samples 0 \
  > "$out/connections.log" 2>&1; echo "1. TP2 without CUDA_DEVICE_MAX_CONNECTIONS: exit $?"
grep -c "set CUDA_DEVICE_MAX_CONNECTIONS=1" "$out/connections.log"; grep -E "iteration +5/" "$out/connections.log" | tail -1
timeout 300 torchrun --nproc-per-node 2 benchmarks/bench_e2e.py --workload W1 --llm-layers 8 \
  --hetero-layout examples/layouts/gpu2_homogeneous_dp2.yaml --out "$out/oom.jsonl" > "$out/oom.log" 2>&1
echo "2. W1 homogeneous DP2: exit $? (non-zero expected)"
grep "^error: " "$out/oom.log"; echo "tracebacks: $(grep -c Traceback "$out/oom.log")"
