#!/usr/bin/env bash
# MoE LLM with expert parallelism on GPUs: examples/pretrain_vlm.py with an LLM shaped like a
# shrunk Qwen3-30B-A3B (hidden 2048, 32 heads, experts of width 768 with top-8 routing; 8 layers and
# 32 experts instead of 48 and 128, so that one GPU holds it), the all-to-all dispatcher, bf16.
# 1 GPU: single.yaml (every expert on the GPU). GPUS=2 adds the colocated layout vision DP2 -> LLM
# DP2/EP2 (gpu2_moe_colocated_ep2.yaml: 16 experts per GPU). Each run prints tokens/s (from the
# metrics file, steps after the first 5) and the forward time of the token dispatcher per iteration
# (benchmarks/time_moe_dispatch.py). Run from the repo root; ONLY="moe_ep2_2gpu" runs the named runs alone.
source benchmarks/gpu_env.sh
GPUS=${GPUS:-1}
LAYOUTS=examples/layouts
MOE="--hidden-size 2048 --num-attention-heads 32 --num-layers 8 --ffn-hidden-size 6144
  --num-experts 32 --moe-router-topk 8 --moe-ffn-hidden-size 768 --moe-aux-loss-coeff 1e-3
  --moe-z-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --seq-length 2048
  --micro-batch-size 4 --global-batch-size 32 --train-iters 30 --lr 1e-4 --log-interval 10 --bf16"
run() {  # name, nproc, layout
  local name=$1 n=$2 layout=$3
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && return
  echo "== $name"
  torchrun --nproc-per-node "$n" benchmarks/time_moe_dispatch.py --hetero-layout "$layout" $MOE \
    --metrics-file "$out/$name.jsonl" > "$out/$name.log" 2>&1; echo "exit $?" >> "$out/$name.log"
  python3 - "$out/$name.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if '"step"' in line]
rates = [r["tokens_per_s"] for r in rows[5:] if r.get("tokens_per_s")]
last = rows[-1] if rows else {}
print(f"tokens/s {sum(rates) / max(len(rates), 1):,.0f} (mean of steps 6-{len(rows)}); last step: loss "
      f"{last.get('loss')}, load_balancing_loss {last.get('load_balancing_loss')}, grad norm {last.get('grad_norm')}")
PY
  grep "MoE dispatch\|^error\|Error\|exit" "$out/$name.log" | head -5
}
run moe_1gpu 1 $LAYOUTS/single.yaml
if [ "$GPUS" -ge 2 ]; then
  run moe_ep2_2gpu 2 $LAYOUTS/gpu2_moe_colocated_ep2.yaml
fi
