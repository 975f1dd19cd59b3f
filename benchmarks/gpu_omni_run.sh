#!/usr/bin/env bash
# Qwen2.5-Omni-7B's thinker (bench_e2e's qwen2_5_omni_7b: every sample one 30-s 640 x 360 video sampled
# at 2 fps, capped at 64 frames and 602112 px a frame: 30 temporal patches of 26 x 46 patches, 8970
# rows; its own 30-s audio track, 3000 feature frames, 750 rows, interleaved with the frames by 2-s
# chunks; text to a 10K sequence; global batch 4 in microbatches of 1), bf16:
# PART 1: the step on one GPU (GPU 0) at the deepest LLM that fits: LAYERS1 of its 28 layers (default:
#   the deepest of 28, 24, ..., 4, 2 that `megatron-hetero plan` says fits this card; a run out of
#   memory is retried at half the depth), every module's layers recomputed (full, uniform): MFU, each
#   module's FLOPs and phases, and the order of the modules' work in a step.
# PART 2: on 4 GPUs, the whole 28-layer LLM under the heterogeneous layouts and the strongest
#   homogeneous ones (the encoders inheriting the LLM's layout; `megatron-hetero plan --workload
#   qwen2_5_omni_7b --gpus 4 --layouts examples/layouts/gpu4_omni_*.yaml` ranks them), the distributed
#   optimizer, each with the recomputation the planner says fits ("layout:N": the first N layers of
#   every module, "full": all), 1 warm-up and STEPS timed steps.
# No run starts after BUDGET_S seconds from the start; each is killed after RUN_TIMEOUT (default 300 s: a
# 7B-scale model takes two minutes and more to reach its first step).
# Out ($OUT): hardware.txt, omni.jsonl, omni.log, table.md (the runs, then MFU, each module's FLOPs and
# phases, and the order of the work).
# Usage: [PART=1|2|both] [LAYERS1=N] [CARD=0 (part 1's)] [MEM80=1] [STEPS=10] [RUNS="layout:recompute ..."] [BUDGET_S=270] [PEAK=989]
#        benchmarks/gpu_omni_run.sh
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
W=qwen2_5_omni_7b STEPS=${STEPS:-10} PART=${PART:-both}
RUNS=${RUNS:-"gpu4_omni_colocated_vcp2dp2_atp2dp2_ltp2cp2sp:22 gpu4_omni_homogeneous_tp2dp2:full gpu4_omni_colocated_vdp4_adp4_ltp2dp2:full gpu4_omni_homogeneous_dp4:full"}
recompute_flags() {  # full | 0 | N
  case $1 in
    0) echo "--use-distributed-optimizer" ;;
    full) echo "--use-distributed-optimizer --recompute-granularity full --recompute-method uniform --recompute-num-layers 1" ;;
    *) echo "--use-distributed-optimizer --recompute-granularity full --recompute-method block --recompute-num-layers $1" ;;
  esac
}
bench() {  # gpus, layout, recompute, LLM layers, steps
  if [ $((SECONDS - start)) -gt "${BUDGET_S:-270}" ]; then echo "$2 [$3, $4 layers]: skipped (time)"; return 2; fi
  echo "== $(date +%T) $2: $1 GPU(s), LLM $4 layers, recompute $3" | tee -a "$out/omni.log"
  timeout -s KILL "${RUN_TIMEOUT:-300}" torchrun --standalone --nproc-per-node "$1" benchmarks/bench_e2e.py --workload $W \
    --llm-layers "$4" --global-batch 4 --micro-batch 1 --warmup 1 --steps "$5" --hetero-layout "examples/layouts/$2.yaml" \
    --flags="$(recompute_flags "$3")" --peak "${PEAK:-989}" --out "$out/omni.jsonl" "${cap[@]}" >> "$out/omni.log" 2>&1
  local rc=$?
  [ $rc = 0 ] && { echo "ran in $((SECONDS - start)) s"; return 0; }
  echo "exit $rc: $(grep -E '^error|out of memory' "$out/omni.log" | tail -1 | cut -c1-300)"
  grep -q "out of memory" <(tail -50 "$out/omni.log") && return 1 || return 2
}
planned_depth() {  # the deepest LLM the planner fits on one card of this GPU's memory (2 if none)
  local gb layers
  gb=$(python3 -c 'import torch; print(torch.cuda.get_device_properties(0).total_memory / 1e9)')
  for layers in 28 24 20 16 12 8 6 4; do
    python3 -m megatron_hetero.cli plan --workload $W --gpus 1 --gpu-memory-gb "$gb" --llm-layers $layers \
      --distributed-optimizer --allow-recompute --layouts examples/layouts/single_omni.yaml 2>/dev/null \
      | grep -q "single_omni.yaml: .* fits " && { echo $layers; return; }
  done
  echo 2
}
cap=()  # MEM80=1 on cards of more than 80 GB: an emulated 80 GB card (benchmarks/gpu4_headline_run.sh)
if [ -n "${MEM80:-}" ] && python3 -c 'import sys, torch; sys.exit(torch.cuda.get_device_properties(0).total_memory <= 80 * 2**30)'; then
  cap=(--gpu-memory-gib "${CAP_GIB:-76}")
fi
if [ "$PART" != 2 ]; then
  layers=${LAYERS1:-$(planned_depth)}
  echo "one GPU: LLM $layers of 28 layers"
  # one GPU, 3 timed steps: the phases' pass takes 3 more
  until CUDA_VISIBLE_DEVICES=${CARD:-0} bench 1 single_omni full "$layers" 3; [ $? != 1 ] || [ "$layers" -le 1 ]; do
    layers=$((layers / 2))
  done
fi
if [ "$PART" != 1 ]; then
  for run in $RUNS; do  # out of memory: again with 4 more recomputed layers, then all
    layout=${run%%:*} recompute=${run##*:}
    until bench 4 "$layout" "$recompute" 28 "$STEPS"; [ $? != 1 ] || [ "$recompute" = full ]; do
      recompute=$((recompute + 4)); [ "$recompute" -ge 28 ] && recompute=full
    done
  done
fi
python3 benchmarks/bench_e2e.py --report "$out/omni.jsonl" --peak "${PEAK:-989}" > "$out/table.md" 2>&1; cat "$out/table.md"
