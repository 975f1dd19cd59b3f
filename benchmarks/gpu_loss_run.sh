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
# against; it needs about twice a bf16 run's activations, so give it the card alone: CARDS="0"). E.g.
# RUNS="fused_s1 fused_s2" after a change of the fused path only (put the unfused runs' records beside them
# in $OUT: compare.md reads every <run>.jsonl there), or "fused_s1_b fused-nobda_s1 fused-flash_s1" to tell
# which change moves a seed's curve.
# Out: hardware.txt, <run>.jsonl (bench_e2e's record, every step's loss), loss.log, compare.md.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
W=${WORKLOAD:-qwen2_5_vl_7b}
unfused=(env MEGATRON_HETERO_MLP_KERNEL=torch MEGATRON_HETERO_NORM_KERNEL=torch MEGATRON_HETERO_EAGER_ROPE=1
         MEGATRON_HETERO_EMBEDDING_GRAD=torch)
run() {  # lane, card, name <arm>_s<seed>[_<repeat>]
  local lane=$1 card=$2 name=$3 arm=${3%%_s*} seed=${3#*_s} backend=auto
  seed=${seed%%_*}
  local prefix=(env) fused=--cross-entropy-loss-fusion precision=()
  case $arm in
    fp32) precision=(--fp32) ;&  # the unfused path in fp32
    unfused) prefix=("${unfused[@]}") backend=unfused fused=--no-bias-dropout-fusion ;;
    fused) ;;
    fused-nobda) fused="$fused --no-bias-dropout-fusion" ;;
    fused-flash) backend=flash ;;
    fused-quack) prefix=(env MEGATRON_HETERO_LOSS_KERNEL=quack) ;;
    *) echo "$name: no arm $arm (unfused, fused, fused-nobda, fused-flash, fused-quack, fp32)" | tee -a "$out/loss.log"; return ;;
  esac
  CUDA_VISIBLE_DEVICES=$card "${prefix[@]}" timeout -s KILL "${RUN_S:-280}" torchrun --nproc-per-node 1 \
    --master-port $((29800 + lane)) benchmarks/bench_e2e.py --workload "$W" --llm-layers "${LLM_LAYERS:-2}" \
    --items-per-sample "${ITEMS:-4}" --global-batch "${GB:-2}" --hetero-layout examples/layouts/single.yaml \
    --warmup 0 --steps "${STEPS:-200}" --out "$out/$name.jsonl" "${precision[@]}" \
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
python3 - "$out" > "$out/compare.md" <<'PY'
import json, re, sys
from pathlib import Path

runs = {}  # seed -> {name: losses}
for path in sorted(Path(sys.argv[1]).glob("*.jsonl")):
    match = re.fullmatch(r"([a-z0-9-]+)_s(\d+)(_\w+)?", path.stem)
    if match and path.read_text().strip():
        runs.setdefault(int(match[2]), {})[path.stem] = json.loads(path.read_text().splitlines()[-1])["losses"]

def relative(a, b, steps):  # the largest relative difference of a from b over these steps
    return max(abs(a[i] - b[i]) / abs(b[i]) for i in steps)

def table(arm, noise):  # every run against its seed's first run of `arm`
    print(f"Each run against its seed's first {arm} run: the largest relative difference over all steps and"
          f" from step 51, that of the means of the last 50 steps (signed), the largest absolute difference."
          f" {noise}\n")
    print("| seed | run | steps | largest, all steps | largest, from step 51 | last 50 steps' means | largest absolute |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for seed, mine in sorted(runs.items()):
        reference = next((n for n in sorted(mine) if n.startswith(arm + "_")), None)
        if reference is None:
            print(f"| {seed} | no {arm} run | | | | | |")
            continue
        ref = mine[reference]
        for name, losses in sorted(mine.items(), key=lambda item: (not item[0].startswith("unfused_"), item[0])):
            if name == reference:
                continue
            n = min(len(ref), len(losses))
            tail = range(max(0, n - 50), n)
            mean = lambda x: sum(x[i] for i in tail) / len(tail)
            print(f"| {seed} | {name} vs {reference} | {n} | {relative(losses, ref, range(n)):.2e} | "
                  f"{relative(losses, ref, range(min(50, n), n)) if n > 50 else float('nan'):.2e} | "
                  f"{(mean(losses) - mean(ref)) / mean(ref):+.2e} | "
                  f"{max(abs(losses[i] - ref[i]) for i in range(n)):.2e} |")


table("unfused", "The unfused repeats' rows are the noise (the kernels' own non-determinism).")
if any(name.startswith("fp32_") for mine in runs.values() for name in mine):
    print()
    table("fp32", "How far each bf16 path lies from fp32 weights and compute: the fused path's rows beside the"
                  " unfused runs' say whether its kernels cost accuracy or only round differently.")
PY
cat "$out/compare.md"
