#!/usr/bin/env bash
# Checkpoints on one GPU: save/load time and size of the W1 model (LLM shrunk to
# $LLM_LAYERS layers) with megatron-core's optimizer and with the distributed optimizer, and resume
# on GPU: examples/pretrain_vlm.py 10 iterations straight vs 5 + save + resume for 5 (bf16).
source benchmarks/gpu_env.sh
LLM_LAYERS=${LLM_LAYERS:-8}
for extra in "" "--use-distributed-optimizer"; do
  rm -rf /tmp/ckpt_w1
  echo "== W1 L$LLM_LAYERS checkpoint ${extra:-(plain optimizer)}"
  torchrun --nproc-per-node 1 benchmarks/bench_checkpoint.py --workload W1 --llm-layers "$LLM_LAYERS" \
    --hetero-layout examples/layouts/single.yaml --dir /tmp/ckpt_w1 --out "$out/bench_checkpoint.jsonl" \
    --extra $extra >> "$out/bench_checkpoint.log" 2>&1 || tail -5 "$out/bench_checkpoint.log"
  tail -1 "$out/bench_checkpoint.jsonl"
done
RESUME="--hetero-layout examples/layouts/single.yaml --train-iters 10 --global-batch-size 32 --micro-batch-size 8
  --lr 1e-3 --log-interval 1 --bf16 --save-interval 5"
rm -rf /tmp/ckpt_resume
torchrun --nproc-per-node 1 examples/pretrain_vlm.py $RESUME --save /tmp/ckpt_resume \
  --metrics-file "$out/resume_straight.jsonl" > "$out/resume_straight.log" 2>&1; echo "straight exit $?"
echo 5 > /tmp/ckpt_resume/latest_checkpointed_iteration.txt
torchrun --nproc-per-node 1 examples/pretrain_vlm.py $RESUME --load /tmp/ckpt_resume \
  --metrics-file "$out/resume_resumed.jsonl" > "$out/resume_resumed.log" 2>&1; echo "resumed exit $?"
python3 - "$out" <<'PY'
import json, sys
load = lambda n: {r["step"]: r for r in map(json.loads, open(f"{sys.argv[1]}/{n}.jsonl")) if "loss" in r}
a, b = load("resume_straight"), load("resume_resumed")
for s in sorted(b):
    print(s, a[s]["loss"], b[s]["loss"], a[s]["grad_norm"], b[s]["grad_norm"],
          "equal" if (a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]) else "DIFFERENT")
PY
