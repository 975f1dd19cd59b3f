#!/usr/bin/env bash
# A/B on one card: bench_e2e of each workload under the one-GPU layout, A and B alternating A B A B on
# card $CARD (default 0), then the medians (benchmarks/ab_summary.py) and one profiled step of B. A is the
# baseline checkout BASE_REV (benchmarks/gpu_env.sh's baseline_checkout), or this one where BASE_REV is
# unset; B is this checkout; A_ENV / B_ENV: environment assignments for each arm's runs (kernel policy
# overrides, models/kernel_policy.py); FLAGS: Megatron flags for both arms' runs (bench_e2e's --flags), e.g.
# FLAGS="--attention-backend auto --cross-entropy-loss-fusion"; e.g. the MoE's experts on SequentialMLP
# against grouped GEMMs:
#   A_ENV=MEGATRON_HETERO_EXPERTS_KERNEL=sequential B_ENV=MEGATRON_HETERO_EXPERTS_KERNEL=grouped \
#   WORKLOADS="qwen3_vl_30b_a3b qwen3_vl_4b" benchmarks/gpu_ab_run.sh
# C_FLAGS / C_ENV: a third arm C, this checkout with FLAGS and then these flags (the last of a repeated flag
# wins), B_ENV and then these assignments, e.g. C_FLAGS="--no-bias-dropout-fusion" to tell one change of B
# from the rest; ARMS: the arms each round runs (default "A B", "A B C" with C_FLAGS or C_ENV).
# BENCH_ARGS: bench_e2e arguments for every arm's runs, e.g. "--items-per-sample 6".
# Out ($OUT): hardware.txt, A.jsonl, B.jsonl (C.jsonl), ab.log, summary.md, profile_B_<workload>.md (not with PROFILE=0;
# PROFILE=all: each arm's last run profiled, profile_<arm>_<workload>.md, each one's kernel time in summary.md).
# Usage: BASE_REV=REV [BASE_DIR=.base] | A_ENV="VAR=VALUE ..." B_ENV="VAR=VALUE ..." [CARD=0] [C_FLAGS="..."] [C_ENV="..."]
#        [ARMS="A B C"]
#        [WORKLOADS="qwen2_5_vl_7b"] [FLAGS="..."] [BENCH_ARGS="..."] [LLM_LAYERS=4] [STEPS=5] [ROUNDS=2] [RUN_S=300] [BUDGET_S=480] [FA4_SITE=DIR]
#        [PROFILE=0|1|all]
#        benchmarks/gpu_ab_run.sh
set -uo pipefail
start=$SECONDS
if [[ " ${ARMS:-A} " == *" A "* ]] && [ -z "${BASE_REV:-}${A_ENV:-}${B_ENV:-}" ]; then
  echo "error: name the baseline revision (BASE_REV) or the arms' environments (A_ENV, B_ENV)"; exit 2
fi
source "$(dirname "$0")/gpu_env.sh"
if [ -n "${BASE_REV:-}" ]; then baseline_checkout "$BASE_REV" || exit 2; fi
out=$(realpath "$out")
e2e() {  # variant (A/B), workload, extra bench_e2e arguments
  if [ $((SECONDS - start)) -gt "${BUDGET_S:-480}" ]; then echo "$1 $2: skipped (time)"; return; fi
  local dir=$PWD path=$PYTHONPATH arm_env=${B_ENV:-}
  [ "$1" = C ] && arm_env="${B_ENV:-} ${C_ENV:-}"
  if [ "$1" = A ]; then
    arm_env=${A_ENV:-}
    if [ -n "${BASE_REV:-}" ]; then dir=$base path=$BASE_PATH; fi
  fi
  local bench=benchmarks/bench_e2e.py  # tools/ in trees older than the benchmarks/ folder
  [ -f "$dir/$bench" ] || bench=tools/bench_e2e.py
  echo "== $(date +%T) $1 $2 ${arm_env}" >> "$out/ab.log"
  # shellcheck disable=SC2086  # the arm's assignments and BENCH_ARGS, one word each
  (cd "$dir" && env $arm_env CUDA_VISIBLE_DEVICES=${CARD:-0} PYTHONPATH=$path timeout "${RUN_S:-300}" torchrun --standalone \
    --nproc-per-node 1 "$bench" --workload "$2" --llm-layers "${LLM_LAYERS:-4}" --hetero-layout examples/layouts/single.yaml \
    --warmup 2 --steps "${STEPS:-5}" --out "$out/$1.jsonl" ${BENCH_ARGS:-} "${@:3}") >> "$out/ab.log" 2>&1
  echo "$1 $2: exit $? at $((SECONDS - start)) s"
}
read -r -a workloads <<< "${WORKLOADS:-qwen2_5_vl_7b}"
default_arms="A B"; [ -n "${C_FLAGS:-}${C_ENV:-}" ] && default_arms="A B C"
read -r -a arms <<< "${ARMS:-$default_arms}"
flags=(); [ -n "${FLAGS:-}" ] && flags=("--flags=$FLAGS")
for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
  for w in "${workloads[@]}"; do
    for arm in "${arms[@]}"; do
      extra=()
      if [ "$round" = "${ROUNDS:-2}" ] && { [ "${PROFILE:-1}" = all ] || { [ "$arm" = B ] && [ "${PROFILE:-1}" = 1 ]; }; }; then
        extra=(--profile "$out/profile_${arm}_$w.md")
      fi
      arm_flags=("${flags[@]}"); [ "$arm" = C ] && arm_flags=("--flags=${FLAGS:-} ${C_FLAGS:-}")
      e2e "$arm" "$w" "${arm_flags[@]}" "${extra[@]}"
    done
  done
done
grep -E "^(attention|mlp|norms|experts|loss):|error:|out of memory" "$out/ab.log" | sort | uniq -c | head -12
# Each arm's file once, though ARMS may name an arm more than once a round (B C B).
summary=(); for arm in $(printf '%s\n' "${arms[@]}" | awk '!seen[$0]++'); do
  [ -f "$out/$arm.jsonl" ] && summary+=("$arm=$out/$arm.jsonl"); done
if [ ${#summary[@]} = 0 ]; then echo "no record: every run stopped (the lines above; $out/ab.log)" | tee "$out/summary.md"
else python3 benchmarks/ab_summary.py "${summary[@]}" | tee "$out/summary.md"; fi
# The profiled steps' GPU work beside their wall time: where the host sets the pace, the arms' kernels
# tell apart what the step times cannot.
for f in "$out"/profile_*.md; do [ -f "$f" ] && echo "$(basename "$f" .md): $(head -1 "$f")" | tee -a "$out/summary.md"; done
echo "done at $((SECONDS - start)) s"
