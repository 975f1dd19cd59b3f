#!/usr/bin/env bash
# The VLM families' whole step on one GPU each, side by side on one host's cards (one family per card,
# in waves of as many families as cards): bench_e2e at the recorded preset (LLM_LAYERS layers, default 4;
# 8 images of 224-1344 px per sample, or InternVL's tiles; global batch 4), 2 warm-up and STEPS timed
# steps, one profiled step (kernel families, costliest kernels, matmuls by shape), then the table.
# A family may name its own depth: FAMILIES="qwen3_vl_8b:2 ...".
# Kernels: --attention-backend BACKEND (default auto: flash-attn-4 where FA4_SITE is set and the head
# dim is checked on this GPU, else SDPA); quack's norms and MLPs where importable.
# Out ($OUT): hardware.txt, table_TAG.md and TAG.tgz (each family's record, log and profile).
# Usage: [FAMILIES=...] [TAG=name] [BACKEND=auto] [LLM_LAYERS=4] [STEPS=5] [RUN_S=300] [FA4_SITE=DIR]
#        benchmarks/gpu_families_profile.sh
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
backend=${BACKEND:-auto}; tag=${TAG:-$backend}
work=/tmp/families_$tag; rm -rf "$work"; mkdir -p "$work"
read -r -a families <<< "${FAMILIES:-qwen2_5_vl_7b qwen3_vl_8b qwen3_vl_30b_a3b internvl3_8b}"
cards=${CARDS:-$(nvidia-smi -L | wc -l)}
run_family() {  # NAME[:LAYERS] CARD
  local name=${1%%:*} layers=${LLM_LAYERS:-4}
  [[ $1 == *:* ]] && layers=${1##*:}
  CUDA_VISIBLE_DEVICES=$2 timeout "${RUN_S:-300}" torchrun --standalone --nproc-per-node 1 benchmarks/bench_e2e.py \
    --workload "$name" --llm-layers "$layers" --hetero-layout examples/layouts/single.yaml \
    --flags "--attention-backend $backend" --warmup 2 --steps "${STEPS:-5}" --out "$work/$name.jsonl" \
    --profile "$work/profile_$name.md" > "$work/$name.log" 2>&1
  echo "$name ($layers LLM layers, card $2): exit $?"
}
for ((i = 0; i < ${#families[@]}; i += cards)); do
  for ((c = 0; c < cards && i + c < ${#families[@]}; c++)); do run_family "${families[i + c]}" "$c" & done
  wait
done
grep -hE "^(attention|norms|mlp):|^error|out of memory" "$work"/*.log | sort | uniq -c | head -12
cat "$work"/*.jsonl > "$work/all.jsonl" 2>/dev/null
python3 benchmarks/bench_e2e.py --report "$work/all.jsonl" | tee "$out/table_$tag.md"
for p in "$work"/profile_*.md; do [ -f "$p" ] && { echo "== $p"; head -12 "$p"; }; done
tar -czf "$out/$tag.tgz" -C "$work" .
