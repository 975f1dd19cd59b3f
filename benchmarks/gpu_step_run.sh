#!/usr/bin/env bash
# The whole step on one GPU (about 9 minutes; W1 at 8 LLM layers needs an H200, 80 GB is short):
# the kernels behind the step's non-matmul time (tools/bench_ops.py), then W1 and W3 end to end
# (bench_e2e, LLM shrunk to $LLM_LAYERS layers) with this checkout and, on the same card, with a copy
# of it without the gradient-accumulation-fusion and fused-Adam patches (megatron-core's own
# fallbacks without apex: --no-gradient-accumulation-fusion, torch's foreach Adam), $RUNS times
# interleaved (default 2); `PROFILE=1` adds a profile of W1 (profile_W1.md), `OPS=0` skips bench_ops.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
LLM_LAYERS=${LLM_LAYERS:-8}
[ "${OPS:-1}" = 0 ] || timeout 180 python3 tools/bench_ops.py --workload W1 --llm-layers "$LLM_LAYERS" --json "$out/ops.jsonl" \
  > "$out/ops.log" 2>&1; echo "bench_ops: exit $?"
before=/tmp/before_fusion
rm -rf $before && cp -r . $before
sed -i '/grad_accum_fusion.apply()\|fused_adam.apply()/d' $before/megatron_hetero/patches/__init__.py
sed -i 's/"masked_softmax_fusion")/"masked_softmax_fusion", "gradient_accumulation_fusion")/' $before/megatron_hetero/patches/startup.py
grep -q '"gradient_accumulation_fusion")' $before/megatron_hetero/patches/startup.py && ! grep -q "fused_adam.apply()" \
  $before/megatron_hetero/patches/__init__.py || { echo "the copy without the patches could not be made: see the sed lines"; exit 1; }
install_checkout $before /tmp/before_fusion_site || { echo "the copy without the patches did not install"; exit 1; }
e2e() {  # checkout, workload, layout, record tag, extra flags
  site=/tmp/megatron_hetero_site; [ "$1" = "$before" ] && site=/tmp/before_fusion_site
  (cd "$1" && PYTHONPATH=$site:/tmp/site timeout 240 torchrun --nproc-per-node 1 benchmarks/bench_e2e.py --workload "$2" \
    --llm-layers "$LLM_LAYERS" --hetero-layout "examples/layouts/$3.yaml" --out "$out/bench_e2e_$4.jsonl" "${@:5}" \
    >> "$out/bench_e2e.log" 2>&1); echo "$2 $4: exit $?"
}
for run in $(seq "${RUNS:-2}"); do  # interleaved: the card's clock drifts
  e2e "$PWD" W1 single fused; e2e $before W1 single before
  e2e "$PWD" W3 single_frozen fused; e2e $before W3 single_frozen before
done
[ -n "${PROFILE:-}" ] && e2e "$PWD" W1 single profile --profile "$out/profile_W1.md"
for tag in fused before; do python3 benchmarks/bench_e2e.py --report "$out/bench_e2e_$tag.jsonl"; done
