#!/usr/bin/env bash
# The megatron.training integration on GPUs: Megatron-LM's unchanged pretrain_vlm.py through
# `python -m megatron_hetero.launch`, stock and under --hetero-layout, then examples/pretrain_vlm.py.
# GPUS=2 adds the 2-GPU runs (colocated vision DP2 -> LLM TP2, non-colocated vision GPU 0 -> LLM GPU 1,
# and the stock TP2 run). Run from the repo root; Megatron-LM's scripts from $MEGATRON_LM (default
# .mlm/, a Megatron-LM checkout), megatron-core from .whl/.
source benchmarks/gpu_env.sh
GPUS=${GPUS:-1}
MLM=${MEGATRON_LM:-.mlm}
LAYOUTS=examples/layouts
run() {  # name, nproc, command...
  local name=$1 n=$2; shift 2
  echo "== $name"
  torchrun --nproc-per-node "$n" "$@" > "$out/$name.log" 2>&1; echo "exit $?" >> "$out/$name.log"
  grep -o "elapsed time per iteration (ms): [0-9.]* .*lm loss: [0-9.E+-]*" "$out/$name.log" | tail -2
  grep "caption accuracy\|^error\|Error" "$out/$name.log" | head -3
}
# LLaVA at a GPU-sized shape: CLIP-style ViT (336 px, patch 14: 576 tokens) and an 8-layer 1024-wide LLM.
VLM="--encoder-num-layers 4 --decoder-num-layers 8 --hidden-size 1024 --num-attention-heads 16
  --seq-length 576 --decoder-seq-length 1024 --max-position-embeddings 2048 --img-h 336 --img-w 336
  --patch-dim 14 --micro-batch-size 4 --global-batch-size 32 --train-iters 40 --eval-interval 1000
  --eval-iters 0 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --transformer-impl local --num-workers 2 --log-interval 10 --ckpt-format torch --bf16"
run mlm_stock_1gpu 1 -m megatron_hetero.launch "$MLM/pretrain_vlm.py" $VLM
run mlm_hetero_single_1gpu 1 -m megatron_hetero.launch "$MLM/pretrain_vlm.py" $VLM --hetero-layout $LAYOUTS/single.yaml
DEMO="--train-iters 1000 --global-batch-size 32 --micro-batch-size 8 --lr 1e-3 --min-lr 1e-4
  --lr-warmup-iters 20 --log-interval 100 --eval-samples 128"
run example_single_1gpu 1 examples/pretrain_vlm.py --hetero-layout $LAYOUTS/single.yaml $DEMO \
  --metrics-file "$out/example_single_1gpu.jsonl"
if [ "$GPUS" -ge 2 ]; then
  run mlm_stock_tp2_2gpu 2 -m megatron_hetero.launch "$MLM/pretrain_vlm.py" $VLM --tensor-model-parallel-size 2
  run mlm_colocated_2gpu 2 -m megatron_hetero.launch "$MLM/pretrain_vlm.py" $VLM --hetero-layout $LAYOUTS/gpu2_colocated.yaml
  run mlm_non_colocated_2gpu 2 -m megatron_hetero.launch "$MLM/pretrain_vlm.py" $VLM --hetero-layout $LAYOUTS/gpu2_non_colocated.yaml
  run example_colocated_2gpu 2 examples/pretrain_vlm.py --hetero-layout $LAYOUTS/gpu2_colocated.yaml $DEMO
  run example_non_colocated_2gpu 2 examples/pretrain_vlm.py --hetero-layout $LAYOUTS/gpu2_non_colocated.yaml $DEMO
fi
