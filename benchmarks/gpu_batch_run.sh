#!/usr/bin/env bash
# One H200, at most 9 minutes at the defaults: the whole step's MFU at the presets' own global
# batch. bench_e2e's default global batch of 4 (2 microbatches of 2) pays the optimizer step and the
# gradients' finalize once per 4 samples; W1 and W3 are defined at 16 (planner/presets.py), where the
# same per-step work spreads over 8 microbatches. W1 and W3 (8 LLM layers, flash-attn-4 where $FA4_SITE
# is set) at 4 then 16, alternating workloads, one profiled W1 step at 16 (profile_W1_gb16.md), then the
# medians (benchmarks/ab_summary.py: the global batch is part of each variant). No run starts after BUDGET_S
# (400) seconds; each is bounded by RUN_TIMEOUT (150); PROFILE=0: no profiled run.
#
# With BASE_REV set, a change's A/B instead: that commit's checkout (A, benchmarks/gpu_env.sh's
# baseline_checkout: carry .base) against this one (B), same flags, at global batch 16 only: W1 A B A B,
# then W3 A B while time is left, the first B of each workload profiled (profile_<workload>_gb16.md);
# medians per checkout (ab_summary.py A=... B=...). AB_RUNS: the workloads of the A B pairs in their
# order (default "W1 W1 W3"; W3 on single_frozen, the others on single). FLAGS: more training-script
# flags for every run (bench_e2e --flags, e.g. the recomputation a workload needs on an 80 GB card).
set -uo pipefail
start=$SECONDS
profile() { [ "${PROFILE:-1}" = 0 ] || echo --profile "$out/profile_$1_gb16.md"; }
source "$(dirname "$0")/gpu_env.sh"
out=$(realpath "$out")
if [ -n "${BASE_REV:-}" ]; then baseline_checkout "$BASE_REV" || exit 2; fi
e2e() {  # checkout (A: the baseline, B: this one, -: this one alone), workload, layout, global batch,
         # warm-up steps, timed steps, extra bench_e2e arguments
  if [ $((SECONDS - start)) -gt "${BUDGET_S:-400}" ]; then echo "$2 gb$4 $1: skipped (time)"; return; fi
  local dir=$PWD path=$PYTHONPATH file=$out/bench_e2e.jsonl
  if [ "$1" != - ]; then file=$out/bench_e2e_$1.jsonl; fi
  if [ "$1" = A ]; then dir=$base path=$BASE_PATH; fi
  echo "== $(date +%T) $2 gb$4 checkout $1" >> "$out/bench_e2e.log"
  (cd "$dir" && PYTHONPATH=$path timeout "${RUN_TIMEOUT:-150}" torchrun --nproc-per-node 1 benchmarks/bench_e2e.py --workload "$2" \
    --llm-layers "${LLM_LAYERS:-8}" --hetero-layout "examples/layouts/$3.yaml" --global-batch "$4" --micro-batch 2 \
    --warmup "$5" --steps "$6" --flags="${FLAGS:-}" --out "$file" "${@:7}") >> "$out/bench_e2e.log" 2>&1
  echo "$2 gb$4 $1: exit $? at $((SECONDS - start)) s"
}
if [ -n "${BASE_REV:-}" ]; then
  profiled=""
  for w in ${AB_RUNS:-W1 W1 W3}; do
    layout=single; [ "$w" = W3 ] && layout=single_frozen
    e2e A "$w" $layout 16 1 3
    if [[ " $profiled " = *" $w "* ]]; then e2e B "$w" $layout 16 1 3; else e2e B "$w" $layout 16 1 3 $(profile "$w"); fi
    profiled="$profiled $w"
  done
  summary=(A="$out/bench_e2e_A.jsonl" B="$out/bench_e2e_B.jsonl")
else
  e2e - W1 single 4 2 5; e2e - W1 single 16 1 3 $(profile W1)
  e2e - W3 single_frozen 4 2 5; e2e - W3 single_frozen 16 1 3
  e2e - W1 single 4 2 5; e2e - W1 single 16 1 3
  summary=("$out/bench_e2e.jsonl")
fi
grep -E "^(attention|norms|mlp|error)|Error" "$out/bench_e2e.log" | sort | uniq -c | head -8
python3 benchmarks/ab_summary.py "${summary[@]}" | tee "$out/summary.md"
for f in "$out"/profile_*_gb16.md; do [ -f "$f" ] && head -12 "$f"; done
