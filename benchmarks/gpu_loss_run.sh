#!/usr/bin/env bash
# Do the fused kernels learn as the unfused ones do? $STEPS steps (default 200) of a family's whole step
# ($WORKLOAD, default qwen2_5_vl_7b at $LLM_LAYERS LLM layers, $ITEMS images per sample, global batch $GB)
# on one card each, bf16: the fused path (the kernel policy's auto: flash-attn-4 and quack where FA4_SITE
# carries them, the aligned SwiGLU MLP, the fused RoPE and the packed ViT's fused attention input,
# megatron-core's fused cross entropy (quack's where the GPU passed `kernels check loss`) and bias-dropout-add,
# the windows on torch's varlen flash-attention, the embedding's gradient into main_grad) against the unfused
# one (SDPA attention, megatron-core's MLP, norms, attention, cross entropy and bias-dropout-add on torch,
# upstream's eager RoPE and embedding gradient), for two seeds of the initial weights.
# bench_e2e repeats one global batch at a constant learning rate ($LR), so the loss falls as the model
# learns that batch. The noise: each seed's unfused run twice (what bf16 and the kernels' own
# non-determinism make of one configuration). Six runs, timing not the point, spread over the lanes of
# $CARDS (default: one lane per card, two on a one-GPU machine; "0 0 0": three lanes side by side on
# card 0, where at LLM_LAYERS=2 ITEMS=2 GB=1 on an H200 two of the six runs ran out of memory), each lane
# running its runs one after another.
# RUNS: names <arm>_s<seed>[_<repeat>] (default the six: each seed's unfused run twice, its fused run
# once); arms: unfused, fused, fused-nobda (the fused path with --no-bias-dropout-fusion), fused-flash
# (the fused path under --attention-backend flash: the windows on flash-attn-4 too), fused-quack (the fused
# path with the loss on quack's cross entropy, checked or not: MEGATRON_HETERO_LOSS_KERNEL=quack), fp32 (the
# unfused path in fp32 weights and compute, bench_e2e --fp32: the reference both bf16 paths are judged
# against; it needs about twice a bf16 run's activations, so give it the card alone: CARDS="0"),
# unfused-efficient (the unfused path with torch's attention on its memory-efficient kernel alone,
# bench_e2e --sdpa efficient: what another rounding of one unfused kernel makes of the curve). E.g.
# RUNS="fused_s1 fused_s2" after a change of the fused path only (put the unfused runs' records beside them
# in $OUT: compare.md reads every <run>.jsonl there), or "fused_s1_b fused-nobda_s1 fused-flash_s1" to tell
# which change moves a seed's curve.
# Out: hardware.txt, <run>.jsonl (bench_e2e's record, every step's loss), loss.log, compare.md
# (benchmarks/compare_losses.py --runs: each run against the unfused and fp32 ones, and where it lies among the
# unfused runs step by step).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=${WORKLOAD:-qwen2_5_vl_7b}
unfused=(env MEGATRON_HETERO_MLP_KERNEL=torch MEGATRON_HETERO_NORM_KERNEL=torch MEGATRON_HETERO_EAGER_ROPE=1
         MEGATRON_HETERO_EMBEDDING_GRAD=torch)
run() {  # lane, card, name <arm>_s<seed>[_<repeat>]
  local lane=$1 card=$2 name=$3 arm=${3%%_s*} seed=${3#*_s} backend=auto
  seed=${seed%%_*}
  local prefix=(env) fused=--cross-entropy-loss-fusion args=()
  case $arm in
    fp32) args=(--fp32) ;&  # the unfused path in fp32
    unfused | unfused-efficient) prefix=("${unfused[@]}") backend=unfused fused=--no-bias-dropout-fusion
      if [ "$arm" = unfused-efficient ]; then args=(--sdpa efficient); fi ;;
    fused) ;;
    fused-nobda) fused="$fused --no-bias-dropout-fusion" ;;
    fused-flash) backend=flash ;;
    fused-quack) prefix=(env MEGATRON_HETERO_LOSS_KERNEL=quack) ;;
    *) echo "$name: no arm $arm (unfused, fused, fused-nobda, fused-flash, fused-quack, fp32, unfused-efficient)" | tee -a "$out/loss.log"; return ;;
  esac
  CUDA_VISIBLE_DEVICES=$card "${prefix[@]}" timeout -s KILL "${RUN_S:-280}" torchrun --nproc-per-node 1 \
    --master-port $((29800 + lane)) benchmarks/bench_e2e.py --workload "$W" --llm-layers "${LLM_LAYERS:-2}" \
    --items-per-sample "${ITEMS:-4}" --global-batch "${GB:-2}" --hetero-layout examples/layouts/single.yaml \
    --warmup 0 --steps "${STEPS:-200}" --out "$out/$name.jsonl" "${args[@]}" \
    --flags="--seed $seed --lr ${LR:-2e-5} --attention-backend $backend $fused" > "/tmp/loss_$name.log" 2>&1
  echo "$name on card $card: exit $?; $(grep -E '^(attention|mlp|norms|loss):' "/tmp/loss_$name.log" | sort -u | tr '\n' ' ')" \
    | tee -a "$out/loss.log"
}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
default_cards=$(seq -s ' ' 0 $((gpus - 1))); [ "$gpus" -le 1 ] && default_cards="0 0"
read -r -a cards <<< "${CARDS:-$default_cards}"
read -r -a runs <<< "${RUNS:-unfused_s1_a unfused_s1_b unfused_s2_a unfused_s2_b fused_s1 fused_s2}"
for lane in "${!cards[@]}"; do
  (for ((i = lane; i < ${#runs[@]}; i += ${#cards[@]})); do run "$lane" "${cards[$lane]}" "${runs[$i]}"; done) &
done
wait
python3 benchmarks/compare_losses.py --runs "$out" > "$out/compare.md"
cat "$out/compare.md"
