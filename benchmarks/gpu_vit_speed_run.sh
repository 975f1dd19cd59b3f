#!/usr/bin/env bash
# On one H200, at most 9 minutes: the packed ViT of
# bench_e2e's qwen2_5_vl_7b (LLM 4 layers, 8 images of 224-1344 px per sample) before and after its
# segments were planned once per forward (models/varlen.py) and packed calls took zero-padded
# flash-attn-4 under --attention-backend auto, alternating on the same card, then the medians
# (benchmarks/ab_summary.py) and one profiled step of the new path. Variants (bench_e2e's layout column):
#   single                              A: the baseline checkout (per-layer segments, SDPA per shape)
#   single [--attention-backend auto]   C: this checkout, auto (the ViT's 16 x 80 on FA4 padded to 96)
#   single [--attention-backend unfused] B: this checkout on SDPA everywhere (the planning alone; the
#                                        LLM's attention is on SDPA too here, unlike A and C)
# Order A C B A C; each run stops at 150 s and no run starts after 420 s. No Qwen3-VL bench preset yet.
# Look for: C against A in summary.md (tokens/s, TFLOPS/GPU), the "attention:" lines (vision: fa4 (head
# dim 80 zero-padded to 96) for C), and in profile_new.md no "Memcpy HtoD (Pageable", far fewer fill /
# index kernels and one attention call per layer instead of one per segment shape.
#
# The baseline: the commit before the change, BASE_REV (default efed29c), as benchmarks/gpu_env.sh's
# baseline_checkout finds it (a carried .base tree, else a git worktree).
# flash-attn-4: importable where $FA4_SITE is set (benchmarks/gpu_env.sh; installed by benchmarks/gpu_fa4_check.sh
# on this warm machine; its checked head dims, $FA4_SITE/checked_head_dims.txt, are used when there); without it
# every variant runs SDPA and C equals B. Out ($OUT, 5 files): hardware.txt, bench_e2e.jsonl,
# bench_e2e.log, summary.md, profile_new.md.
set -uo pipefail
start=$SECONDS
source "$(dirname "$0")/gpu_env.sh"
[ -n "${FA4_SITE:-}" ] || echo "warning: FA4_SITE unset: flash-attn-4 is not importable, C runs SDPA" | tee -a "$out/bench_e2e.log"
baseline_checkout "${BASE_REV:-efed29c}" || exit 2
e2e() {  # variant (A/B/C), extra bench_e2e arguments
  if [ $((SECONDS - start)) -gt 420 ]; then echo "$1: skipped (time)"; return; fi
  local dir=$PWD path=$PYTHONPATH flags=""
  case $1 in
    A) dir=$base path=$BASE_PATH ;;
    B) flags="--attention-backend unfused" ;;
    C) flags="--attention-backend auto" ;;
  esac
  echo "== $(date +%T) variant $1" >> "$out/bench_e2e.log"
  (cd "$dir" && PYTHONPATH=$path timeout 150 torchrun --nproc-per-node 1 benchmarks/bench_e2e.py --workload qwen2_5_vl_7b \
    --llm-layers "${LLM_LAYERS:-4}" --hetero-layout examples/layouts/single.yaml --warmup 2 --steps "${STEPS:-3}" \
    --out "$out/bench_e2e.jsonl" --flags "$flags" "${@:2}") >> "$out/bench_e2e.log" 2>&1
  echo "$1: exit $? at $((SECONDS - start)) s"
}
out=$(realpath "$out")
e2e A; e2e C; e2e B; e2e A; e2e C --profile "$out/profile_new.md"
grep -E "^(attention|error)|Error" "$out/bench_e2e.log" | sort | uniq -c | head -8
python3 benchmarks/ab_summary.py "$out/bench_e2e.jsonl" | tee "$out/summary.md"
[ -f "$out/profile_new.md" ] && head -30 "$out/profile_new.md" | tee -a "$out/summary.md"
echo "done at $((SECONDS - start)) s"
