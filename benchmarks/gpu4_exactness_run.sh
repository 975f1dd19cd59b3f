#!/usr/bin/env bash
# Exactness and faults on 4 GPUs (NCCL), one call of about 5 minutes:
# 1. Megatron-LM's own pretrain_vlm.py ($MEGATRON_LM, default .mlm/, a copy of Megatron-LM's scripts),
#    fp32, dropout 0, $ITERS iterations (default 20), every iteration logged: stock on 1 GPU against
#    --hetero-layout colocated vision DP4 -> LLM TP2/DP2 and non-colocated vision 1 GPU -> LLM 3
#    (the same global batch), lm loss and grad norm compared per iteration (compare.txt);
# 2. checkpoints (examples/pretrain_vlm.py, bf16, distributed optimizer): 20 iterations on 4 GPUs
#    under vision DP4 -> LLM TP2/DP2 saving at 10, then from iteration 10 again on 2 GPUs
#    (gpu2_colocated: vision DP2 -> LLM TP2) and on 1 (single);
# 3. faults: rank 3 SIGKILLed, then SIGSTOPped (hung), in the LLM's forward at iteration 5
#    (tests/fault_script.py): when the other ranks stop and the line they print.
# MLM_RUNS: which of part 1's runs (default all four, stock_tp2dp2 among them: Megatron's own TP2/DP2).
# SKIP_CKPT=1: the first part alone. Out: hardware.txt, mlm.log (part 1's logs), ckpt.log, faults.log, compare.txt.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
MLM=${MEGATRON_LM:-.mlm} L=examples/layouts ITERS=${ITERS:-20}
VLM="$(mlm_vlm_flags "$ITERS" 24) --hidden-dropout 0 --attention-dropout 0 --seed 1234"
# Layout-independent weights and fp32 without TF32: on GPUs Megatron initializes each TP shard from
# its own RNG stream (a TP2 model starts from other weights than the 1-GPU one) unless the full
# weights are made on the CPU and split, and cuDNN's convolutions (the ViT's patch embedding) take
# TF32 by default, whose rounding depends on the batch a GPU convolves.
MLM_EXACT="--use-cpu-initialization"
export NVIDIA_TF32_OVERRIDE=0
mlm() {  # name, nproc, flags...
  local name=$1 n=$2; shift 2
  echo "=== $name" >> "$out/mlm.log"
  # shellcheck disable=SC2086
  # From /tmp: `-m` puts the working directory first on the path, where the checkout's megatron_hetero
  # (without the installed copy's patches) would shadow the installed one.
  (cd /tmp && timeout -s KILL 150 torchrun --nproc-per-node "$n" -m megatron_hetero.launch "$OLDPWD/$MLM/pretrain_vlm.py" \
    $VLM $MLM_EXACT "$@" --metrics-file "/tmp/mlm_$name.jsonl" > "/tmp/mlm_$name.log" 2>&1); echo "mlm $name: exit $?"
  cat "/tmp/mlm_$name.log" >> "$out/mlm.log"
}
# stock_tp2dp2: Megatron's own TP2/DP2 layout (the encoder inheriting it), what a change of layout does to
# fp32 rounding without the plugin: the floor the heterogeneous runs are judged against.
declare -A MLM_FLAGS=([stock_1gpu]="1" [colocated]="4 --hetero-layout $PWD/$L/gpu4_colocated_vdp4_ltp2dp2.yaml"
  [non_colocated]="4 --hetero-layout $PWD/$L/non_colocated_1_3.yaml" [stock_tp2dp2]="4 --tensor-model-parallel-size 2")
rm -f /tmp/mlm_*.jsonl
for name in ${MLM_RUNS:-stock_1gpu colocated non_colocated stock_tp2dp2}; do
  # shellcheck disable=SC2086
  mlm "$name" ${MLM_FLAGS[$name]}
done
python3 - > "$out/compare.txt" <<'PY'
import json, os
# Megatron's lm loss and grad norm per iteration as its training_log receives them (--metrics-file: all
# digits; the printed line has 3 decimals of the norm).
read = lambda n: {r["step"]: (r["loss"], r["grad_norm"]) for r in map(json.loads, open(f"/tmp/mlm_{n}.jsonl"))}
ref = read("stock_1gpu")
for name in (n for n in ("colocated", "non_colocated", "stock_tp2dp2") if os.path.exists(f"/tmp/mlm_{n}.jsonl")):
    got = read(name)
    common = sorted(set(ref) & set(got))
    loss, norm = (max((abs(got[i][k] - ref[i][k]) / abs(ref[i][k]) for i in common), default=None) for k in (0, 1))
    print(f"{name} vs stock 1 GPU: {len(common)} of {len(ref)} iterations, largest relative difference: "
          f"lm loss {loss}, grad norm {norm}; within 1e-5: {loss is not None and loss < 1e-5 and norm < 1e-5}")
    print("  per iteration (lm loss / grad norm, relative): " + ", ".join(
        f"{i}: {abs(got[i][0] - ref[i][0]) / abs(ref[i][0]):.1e} / {abs(got[i][1] - ref[i][1]) / abs(ref[i][1]):.1e}"
        for i in common))
PY
cat "$out/compare.txt"
CKPT="--train-iters 20 --global-batch-size 32 --micro-batch-size 8 --lr 1e-3 --log-interval 5 --bf16
  --use-distributed-optimizer --save-interval 10 --seed 1234"
ckpt() {  # name, nproc, layout, flags...
  local name=$1 n=$2 layout=$3; shift 3
  # shellcheck disable=SC2086
  timeout -s KILL 150 torchrun --nproc-per-node "$n" examples/pretrain_vlm.py $CKPT --hetero-layout "$L/$layout.yaml" \
    --metrics-file "/tmp/ckpt_$name.jsonl" "$@" >> "$out/ckpt.log" 2>&1; echo "ckpt $name: exit $?"
}
[ -n "${SKIP_CKPT:-}" ] && { cat "$out/compare.txt"; exit 0; }  # the Megatron-LM comparison alone
rm -rf /tmp/ckpt4
ckpt straight 4 gpu4_colocated_vdp4_ltp2dp2 --save /tmp/ckpt4
for run in "on_2_gpus 2 gpu2_colocated" "on_1_gpu 1 single"; do
  echo 10 > /tmp/ckpt4/latest_checkpointed_iteration.txt
  # shellcheck disable=SC2086
  ckpt $run --load /tmp/ckpt4 --save /tmp/ckpt4_$RANDOM
done
python3 - >> "$out/compare.txt" <<'PY'
import json
load = lambda n: {r["step"]: r for r in map(json.loads, open(f"/tmp/ckpt_{n}.jsonl")) if "loss" in r}
a = load("straight")
for name in ("on_2_gpus", "on_1_gpu"):
    b = load(name)
    steps = sorted(s for s in b if s in a)
    worst = max((abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in steps), default=None)
    print(f"resume {name} from the 4-GPU checkpoint at 10: steps {steps}, largest relative loss difference {worst}")
PY
fault() {  # kind, flags...
  local kind=$1; shift
  local start=$(date +%s.%N)
  HETERO_TEST_FAULT=$kind:llm:5:3 HETERO_TEST_KILLED=/tmp/fault_$kind.time timeout -s KILL 120 torchrun \
    --nproc-per-node 4 --master-port 29611 tests/fault_script.py --hetero-layout $L/gpu4_colocated_vdp4_ltp2dp2.yaml \
    --train-iters 20 --global-batch-size 32 --micro-batch-size 8 --lr 1e-3 --log-interval 1 --bf16 "$@" \
    > "/tmp/fault_$kind.log" 2>&1
  local rc=$? end=$(date +%s.%N)
  pkill -9 -f tests/fault_script.py || true
  { echo "=== fault $kind: exit $rc, $(python3 -c "print(f'{$end - float(open(\"/tmp/fault_$kind.time\").read()):.1f}')" 2>/dev/null) s from the fault to the end"
    grep "^error" "/tmp/fault_$kind.log" | sort | uniq -c | head -5; } | tee -a "$out/faults.log" >> "$out/compare.txt"
  cat "/tmp/fault_$kind.log" >> "$out/faults.log"
}
fault kill --hetero-heartbeat-interval 0.5
fault hang --hetero-heartbeat-interval 0.5 --hetero-heartbeat-timeout 20
cat "$out/compare.txt"
