#!/usr/bin/env bash
# Do the fused kernels learn as the unfused ones do? $STEPS steps (default 200) of a family's whole step
# ($WORKLOAD, default qwen2_5_vl_7b at $LLM_LAYERS LLM layers, $ITEMS images per sample, global batch $GB)
# on one card each, bf16: the fused path (the kernel policy's auto: flash-attn-4 and quack where FA4_SITE
# carries them, the aligned SwiGLU MLP, the fused RoPE and the packed ViT's fused attention input,
# megatron-core's fused cross entropy and bias-dropout-add, the windows on torch's varlen flash-attention)
# against the unfused one (SDPA attention, megatron-core's MLP, norms, attention, cross entropy and
# bias-dropout-add on torch, upstream's eager RoPE), for two seeds of the initial weights.
# bench_e2e repeats one global batch at a constant learning rate ($LR), so the loss falls as the model
# learns that batch. The noise: each seed's unfused run twice (what bf16 and the kernels' own
# non-determinism make of one configuration). Six runs, timing not the point, spread over the lanes of
# $CARDS (default: one lane per card, two on a one-GPU machine; "0 0 0": three lanes side by side on
# card 0, where at LLM_LAYERS=2 ITEMS=2 GB=1 on an H200 two of the six runs ran out of memory), each lane
# running its runs one after another.
# RUNS: a subset of the six (e.g. RUNS="fused_s1 fused_s2" after a change of the fused path only; put the
# unfused runs' records beside them in $OUT to compare: compare.md reads <run>.jsonl there).
# Out: hardware.txt, <run>.jsonl (bench_e2e's record, every step's loss), loss.log, compare.md.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=${WORKLOAD:-qwen2_5_vl_7b}
unfused=(env MEGATRON_HETERO_MLP_KERNEL=torch MEGATRON_HETERO_NORM_KERNEL=torch MEGATRON_HETERO_EAGER_ROPE=1)
run() {  # lane, card, name (fused|unfused)_s<seed>[_<repeat>]
  local lane=$1 card=$2 name=$3 seed=${3#*_s} backend=auto
  seed=${seed%%_*}
  local prefix=(env) fused=--cross-entropy-loss-fusion
  [[ $name == unfused* ]] && prefix=("${unfused[@]}") backend=unfused fused=--no-bias-dropout-fusion
  CUDA_VISIBLE_DEVICES=$card "${prefix[@]}" timeout -s KILL "${RUN_S:-280}" torchrun --nproc-per-node 1 \
    --master-port $((29800 + lane)) benchmarks/bench_e2e.py --workload "$W" --llm-layers "${LLM_LAYERS:-2}" \
    --items-per-sample "${ITEMS:-4}" --global-batch "${GB:-2}" --hetero-layout examples/layouts/single.yaml \
    --warmup 0 --steps "${STEPS:-200}" --out "$out/$name.jsonl" \
    --flags="--seed $seed --lr ${LR:-2e-5} --attention-backend $backend $fused" > "/tmp/loss_$name.log" 2>&1
  echo "$name on card $card: exit $?; $(grep -E '^(attention|mlp|norms):' "/tmp/loss_$name.log" | sort -u | tr '\n' ' ')" \
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
python3 - "$out" > "$out/compare.md" <<'PY'
import json, sys
from pathlib import Path

def losses(name):
    path = Path(sys.argv[1]) / f"{name}.jsonl"
    return json.loads(path.read_text().splitlines()[-1])["losses"] if path.exists() else None

def worst(a, b, steps):  # the largest relative difference over these steps
    return max(abs(a[i] - b[i]) / abs(b[i]) for i in steps)

print("| seed | steps | first / last loss (unfused) | unfused repeat vs unfused, largest | fused vs unfused, largest |"
      " fused vs unfused, mean of the last 50 / repeats' |\n| --- | --- | --- | --- | --- | --- |")
for seed in (1, 2):
    a, b, f = losses(f"unfused_s{seed}_a"), losses(f"unfused_s{seed}_b"), losses(f"fused_s{seed}")
    if not (a and b and f):
        print(f"| {seed} | missing runs | | | | |")
        continue
    n = min(len(a), len(b), len(f))
    tail = range(max(0, n - 50), n)
    mean = lambda x: sum(x[i] for i in tail) / len(tail)
    print(f"| {seed} | {n} | {a[0]:.4f} / {a[n - 1]:.4f} | {worst(b, a, range(n)):.2e} | {worst(f, a, range(n)):.2e} | "
          f"{abs(mean(f) - mean(a)) / mean(a):.2e} / {abs(mean(b) - mean(a)) / mean(a):.2e} |")
PY
cat "$out/compare.md"
