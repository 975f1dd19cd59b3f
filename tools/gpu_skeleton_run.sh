#!/usr/bin/env bash
# The walking skeleton on 2 GPUs (NCCL): demo layout scaled to vision TP1/DP2 -> LLM TP2/DP1.
# Run from the repo root on a machine with torch; megatron-core comes from .whl/ if carried.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
out=${OUT:-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/hardware.txt"
python3 -c 'import torch, megatron.core; print("torch", torch.__version__, "megatron-core", megatron.core.__version__)' | tee -a "$out/hardware.txt"
common=(@examples/demo_args.txt --hetero-layout examples/layouts/gpu2_colocated.yaml)
for run in fp32 bf16 ablate; do
  extra=(); [ $run = bf16 ] && extra=(--bf16); [ $run = ablate ] && extra=(--ablate-vision)
  echo "== $run: torchrun --nproc-per-node 2 examples/pretrain_vlm.py ${common[*]} ${extra[*]}"
  torchrun --nproc-per-node 2 examples/pretrain_vlm.py "${common[@]}" "${extra[@]}" \
    --metrics-file "/tmp/gpu2_$run.jsonl" 2>&1 | grep -v "Warning\|warn" | tee "$out/gpu2_$run.log" | grep -v "^ iteration" 
  grep "^ iteration" "$out/gpu2_$run.log" | sed -n '1p;$p'
done
