#!/usr/bin/env bash
# Qwen2.5-VL-7B's speed: bench_e2e on Qwen2.5-VL-7B's own model (workload qwen2_5_vl_7b: its windowed
# native-resolution ViT and Qwen2 LLM with M-RoPE; 8 images of 224-1344 px per sample, 6536 rows, 8K
# sequence; LLM depth shrunk to LLM_LAYERS to fit), on 1 GPU and, with GPUS=2, under 2-GPU layouts.
# Look for: tokens/s, TFLOPS/GPU, the encoder's FLOPs share ("enc FLOPs") in the table; the profile's
# attention share (the ViT runs SDPA per segment length unless flash-attn-4's varlen kernel runs).
# Usage: [GPUS=2] [LLM_LAYERS=4] benchmarks/gpu_qwen2_5_vl_run.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
layers=${LLM_LAYERS:-4}
run() {  # gpus layout [extra flags]
  echo "== $(date +%T) $1 GPU(s) $2"
  torchrun --nproc-per-node "$1" benchmarks/bench_e2e.py --workload qwen2_5_vl_7b --llm-layers "$layers" \
    --hetero-layout "examples/layouts/$2.yaml" --out "$out/bench_e2e_qwen2_5_vl.jsonl" "${@:3}" \
    >>"$out/bench_e2e_qwen2_5_vl.log" 2>&1 || { echo "failed:"; grep -E "Error|error" "$out/bench_e2e_qwen2_5_vl.log" | tail -3; }
}
run 1 single --profile "$out/qwen2_5_vl_profile.md"
if [ "${GPUS:-1}" -ge 2 ]; then
  for layout in gpu2_colocated gpu2_colocated_cp2 gpu2_non_colocated gpu2_homogeneous_tp2; do run 2 "$layout"; done
fi
python3 benchmarks/bench_e2e.py --report "$out/bench_e2e_qwen2_5_vl.jsonl"
