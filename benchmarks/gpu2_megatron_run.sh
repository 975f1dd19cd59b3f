#!/usr/bin/env bash
# Megatron-LM's pretrain_vlm.py, checkpoints and faults on 2 GPUs (NCCL), about 8 minutes:
# 1. Megatron-LM's own pretrain_vlm.py ($MEGATRON_LM, default .mlm/, a Megatron-LM checkout):
#    stock TP2 vs --hetero-layout colocated and non-colocated, the same flags, $ITERS iterations
#    (default 200), dropout 0, bf16, every iteration logged (mlm_*.log: ms/iteration and lm loss);
# 2. checkpoints (examples/pretrain_vlm.py, bf16, distributed optimizer): 20 iterations under the
#    colocated layout saving at 10, then from iteration 10 again under the same layout, under the
#    non-colocated one and on 1 GPU (ckpt_*.jsonl metrics);
# 3. faults on NCCL: rank 1 SIGKILLed, then SIGSTOPped (hung), in the LLM's forward at iteration 5
#    (tests/fault_script.py): when the other rank stops and the line it prints (FAULTS=hang: that one).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
MLM=${MEGATRON_LM:-.mlm} LAYOUTS=examples/layouts ITERS=${ITERS:-200}
VLM="$(mlm_vlm_flags "$ITERS" 16) --bf16 --hidden-dropout 0 --attention-dropout 0 --seed 1234"
mlm() {  # name, flags...
  local name=$1; shift
  timeout 200 torchrun --nproc-per-node 2 -m megatron_hetero.launch "$MLM/pretrain_vlm.py" $VLM "$@" \
    > "$out/mlm_$name.log" 2>&1; echo "mlm $name: exit $?"
  grep -o "elapsed time per iteration (ms): [0-9.]*\|lm loss: [0-9.E+-]*" "$out/mlm_$name.log" | tail -2 | tr '\n' ' '; echo
}
if [ -z "${SKIP_MLM:-}" ]; then
  mlm stock_tp2 --tensor-model-parallel-size 2
  mlm colocated --hetero-layout $LAYOUTS/gpu2_colocated.yaml
  mlm non_colocated --hetero-layout $LAYOUTS/gpu2_non_colocated.yaml
fi
CKPT="--train-iters 20 --global-batch-size 32 --micro-batch-size 8 --lr 1e-3 --log-interval 5 --bf16
  --use-distributed-optimizer --save-interval 10 --seed 1234"
ckpt() {  # name, nproc, layout, flags...
  local name=$1 n=$2 layout=$3; shift 3
  timeout 150 torchrun --nproc-per-node "$n" examples/pretrain_vlm.py $CKPT --hetero-layout "$LAYOUTS/$layout.yaml" \
    --metrics-file "$out/ckpt_$name.jsonl" "$@" > "$out/ckpt_$name.log" 2>&1; echo "ckpt $name: exit $?"
}
if [ -z "${SKIP_CKPT:-}" ]; then
  rm -rf /tmp/ckpt2
  ckpt straight 2 gpu2_colocated --save /tmp/ckpt2
  for run in "same 2 gpu2_colocated" "non_colocated 2 gpu2_non_colocated" "one_gpu 1 single"; do
    echo 10 > /tmp/ckpt2/latest_checkpointed_iteration.txt
    # shellcheck disable=SC2086
    ckpt $run --load /tmp/ckpt2 --save /tmp/ckpt2_$RANDOM
  done
  python3 - "$out" <<'PY'
import json, sys
load = lambda n: {r["step"]: r for r in map(json.loads, open(f"{sys.argv[1]}/ckpt_{n}.jsonl")) if "loss" in r}
a = load("straight")
for name in ("same", "non_colocated", "one_gpu"):
    b = load(name)
    steps = sorted(s for s in b if s in a)
    equal = all((a[s]["loss"], a[s]["grad_norm"]) == (b[s]["loss"], b[s]["grad_norm"]) for s in steps)
    worst = max((abs(a[s]["loss"] - b[s]["loss"]) / abs(a[s]["loss"]) for s in steps), default=None)
    print(f"resume {name}: steps {steps[0] if steps else '-'}-{steps[-1] if steps else '-'}, "
          f"bit-identical {equal}, largest relative loss difference {worst}")
PY
fi
fault() {  # kind (kill or hang), extra flags
  local kind=$1; shift
  local start=$(date +%s.%N)
  # A port of its own, and whatever the fault leaves (a stopped rank) killed after: later runs need 29500.
  HETERO_TEST_FAULT=$kind:llm:5:1 HETERO_TEST_KILLED=$out/fault_$kind.time timeout -s KILL 120 torchrun \
    --nproc-per-node 2 --master-port 29611 tests/fault_script.py --hetero-layout $LAYOUTS/gpu2_colocated.yaml --train-iters 20 --global-batch-size 32 \
    --micro-batch-size 8 --lr 1e-3 --log-interval 1 --bf16 "$@" > "$out/fault_$kind.log" 2>&1
  local rc=$? end=$(date +%s.%N)
  pkill -9 -f tests/fault_script.py || true
  echo "fault $kind: exit $rc, $(python3 -c "print(f'{$end - float(open(\"$out/fault_$kind.time\").read()):.1f}')" 2>/dev/null) s from the fault to the end"
  grep "^error" "$out/fault_$kind.log" | head -3
}
[ -n "${SKIP_FAULTS:-}" ] && FAULTS=""
for kind in ${FAULTS-kill hang}; do  # FAULTS: which of them (default both)
  case $kind in
    kill) fault kill --hetero-heartbeat-interval 0.5 ;;
    hang) fault hang --hetero-heartbeat-interval 0.5 --hetero-heartbeat-timeout 20 ;;
    *) echo "error: FAULTS=$kind: use kill and/or hang"; exit 2 ;;
  esac
done
