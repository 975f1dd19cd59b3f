#!/usr/bin/env bash
# Speed options on 2 GPUs (NCCL), about 5 minutes:
# 1. --overlap-grad-reduce on vs off (and with --use-distributed-optimizer --overlap-param-gather):
#    the demo model, 20 iterations per run, colocated (LLM pp 1 and 2) and non-colocated; per-step
#    loss and grad norm compared (overlap_compare.txt);
# 2. the colocated boundary's local part on GPU 0 at W1's shape (16 images of 729 tokens, hidden
#    4096, bf16): milliseconds, kernels, rate vs a clone (bench_boundary_local*.json);
# 3. the non-colocated round trip against raw send/recv at 64 and 256 MB (bench_boundary.json), and
#    verify_layout (exactness on NCCL, timing): 2 samples of 16 images, one message per sample.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
train() {  # layout name, run name, extra flags
  timeout 150 torchrun --nproc-per-node 2 examples/pretrain_vlm.py @examples/demo_args.txt \
    --hetero-layout examples/layouts/$1.yaml --train-iters 20 --log-interval 5 --lr-warmup-iters 2 \
    --metrics-file "$out/overlap_$2.jsonl" "${@:3}" > "$out/overlap_$2.log" 2>&1
  echo "$2: exit $?"
}
for layout in gpu2_colocated gpu2_colocated_pp2 gpu2_non_colocated; do
  train $layout ${layout}_off
  train $layout ${layout}_on --overlap-grad-reduce
done
train gpu2_colocated gpu2_colocated_distopt_off --use-distributed-optimizer
train gpu2_colocated gpu2_colocated_distopt_on --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
python3 - "$out" <<'PY' | tee "$out/overlap_compare.txt"
import json, sys, pathlib
out = pathlib.Path(sys.argv[1])
for off in sorted(out.glob("overlap_*_off.jsonl")):
    on = pathlib.Path(str(off).replace("_off.jsonl", "_on.jsonl"))
    a, b = ([json.loads(l) for l in p.read_text().splitlines()] if p.exists() else [] for p in (off, on))
    rel = max((abs(x[k] - y[k]) / max(abs(x[k]), 1e-30) for x, y in zip(a, b) for k in ("loss", "grad_norm")), default=None)
    print(f"{off.name[8:-10]}: steps off {len(a)} on {len(b)}, max relative difference of loss/grad norm {rel}")
PY
for w in "" "--micro-batch 4"; do
  timeout 60 torchrun --nproc-per-node 1 benchmarks/bench_boundary_local.py $w \
    --json "$out/bench_boundary_local${w:+_mb4}.json" > "$out/bench_boundary_local${w:+_mb4}.log" 2>&1
  echo "bench_boundary_local $w: exit $?"
done
timeout 120 torchrun --nproc-per-node 2 benchmarks/bench_boundary.py --sizes-mb 64 256 --iters 20 --warmup 5 \
  --dtype bf16 --json "$out/bench_boundary.json" 2>&1 | grep -v "^W11\|\*\*\*\*" | tee "$out/bench_boundary.log" | grep "send\|p2p"
timeout 90 torchrun --nproc-per-node 2 tools/verify_layout.py examples/layouts/gpu2_non_colocated.yaml --dtype bf16 \
  --hidden-size 4096 --tokens-per-image 729 --images-per-sample 16 16 --iters 10 2>&1 \
  | grep -v "^W11\|\*\*\*\*" | tee "$out/verify_layout.log" | grep "edge\|exact"
