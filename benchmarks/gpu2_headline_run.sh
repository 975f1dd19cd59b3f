#!/usr/bin/env bash
# The headline on 2 GPUs, about 9 minutes: the long-context workload W5 (W4's
# 25-head InternViT-6B-wide encoder, 16 images of 1024 tokens per sample, into the 7B LLM at 32K;
# LLM depth $LLM_LAYERS, default 12) under Megatron's homogeneous layouts that can run it and under
# heterogeneous ones, each with and without full recomputation where memory may need it, all with
# the distributed optimizer; then the planner's predictions for the same layouts on this GPU's memory.
# Homogeneous: TP2 (refused: the encoder's 25 heads), DP2, CP2 with the encoder replicated on both
# CP ranks (gpu2_homogeneous_cp2). Heterogeneous: vision DP2 -> LLM TP2+SP, vision DP2 -> LLM CP2.
# Records: $OUT/bench_e2e.jsonl (with each run's step-time spread), planner.txt. The DP2 baseline with
# partial recomputation and the runs the first call had no time for (the default list filled a
# 10-minute call on 2 H200s): BLOCK_LAYERS="6 9" benchmarks/gpu2_headline_run.sh
# On 80 GB cards (H100), where DP2 needs most of its layers recomputed, the strongest homogeneous
# layouts (DP2 with the fewest recomputed layers that fit, the encoder stacked on PP2's first stage)
# against vision DP2 -> LLM TP2+SP with the fewest that fit (on H200: DP2 needed 61.7 GiB fully
# recomputed, 79.6 recomputing 9 of 12; colocated 85.3 recomputing none), and the GPU's bf16
# matmul rate for the planner's calibration: MEM80=1 benchmarks/gpu2_headline_run.sh
# Megatron's PP2 baseline, the encoder stacked on the LLM's first stage (gpu2_homogeneous_pp2_stacked),
# under the recompute and bubbles schedules (bubbles: the encoder's work inside stage 0's 1F1B, as
# Megatron runs it), beside the heterogeneous vision DP2 -> LLM PP2: STACKED=1 benchmarks/gpu2_headline_run.sh
set -uo pipefail
export LLM_LAYERS=${LLM_LAYERS:-12} SKIP_BOUNDARY=1 SKIP_MOE=1
D=--use-distributed-optimizer
R=$D,--recompute-granularity,full,--recompute-method,uniform,--recompute-num-layers,1
# Partial recomputation for the DP2 baseline: the first N layers of each module's block (Megatron's
# --recompute-method block), the rest keeping their activations.
B=$D,--recompute-granularity,full,--recompute-method,block,--recompute-num-layers
S=--hetero-colocated-schedule,bubbles
[ -n "${STACKED:-}" ] && RUNS="W5:gpu2_homogeneous_pp2_stacked:$R W5:gpu2_homogeneous_pp2_stacked:$R,$S
  W5:gpu2_homogeneous_pp2_stacked:$D,$S W5:gpu2_colocated_pp2:$R,$S"
# Five runs of ~100 s each (start-up included) fill a 10-minute call.
[ -n "${MEM80:-}" ] && RUNS="W5:gpu2_homogeneous_dp2:$B,10 W5:gpu2_homogeneous_dp2:$B,11
  W5:gpu2_colocated_sp:$B,3 W5:gpu2_colocated_sp:$B,4 W5:gpu2_homogeneous_pp2_stacked:$R,$S"
[ -n "${BLOCK_LAYERS:-}" ] && RUNS="$(for n in $BLOCK_LAYERS; do printf 'W5:gpu2_homogeneous_dp2:%s,%s ' "$B" "$n"; done)
  W5:gpu2_colocated_cp2:$D W5:gpu2_colocated_sp:$R"
RUNS=${RUNS:-"W5:gpu2_homogeneous_tp2:$D W5:gpu2_colocated_sp:$D W5:gpu2_homogeneous_dp2:$R W5:gpu2_homogeneous_cp2:$D
  W5:gpu2_homogeneous_cp2:$R W5:gpu2_colocated_sp:$R W5:gpu2_colocated_cp2:$D"} \
  bash "$(dirname "$0")/gpu2_layouts_run.sh"
source "$(dirname "$0")/gpu_env.sh" > /dev/null  # the planner imports the installed checkout too
python3 -c 'import torch, time
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(5): a @ b
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(50): a @ b
torch.cuda.synchronize(); print("bf16 matmul 8192^3:", round(50 * 2 * 8192**3 / (time.perf_counter() - t) / 1e12), "TFLOP/s")' | tee -a "$out/hardware.txt"
memory=$(python3 -c 'import torch; print(round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1))')
for layout in gpu2_colocated_sp gpu2_homogeneous_dp2 gpu2_homogeneous_cp2 gpu2_colocated_cp2 \
  gpu2_homogeneous_pp2_stacked gpu2_colocated_pp2; do
  echo "== plan_layout W5 L$LLM_LAYERS, $memory GB: $layout"
  python3 tools/plan_layout.py --workload W5 --llm-layers "$LLM_LAYERS" --gpu-memory-gb "$memory" \
    --calibration megatron_hetero/planner/calibrations/calibration_h200_measured.json --layouts "examples/layouts/$layout.yaml" --top 8
done > "$out/planner.txt" 2>&1
grep -A12 "^best" "$out/planner.txt" | head -30
