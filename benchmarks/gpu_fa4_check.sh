#!/usr/bin/env bash
# flash-attn-4 on one GPU: against fp32 attention at every attention shape the workloads use,
# with each backend's speed (`megatron-hetero kernels check attention`: exit 1 if a chosen path's
# gradients are off), then
# a 200-step loss comparison of examples/pretrain_vlm.py, SDPA (--attention-backend unfused) against
# flash-attn-4 (--attention-backend flash: the LLM's head dim 128 as it is, the ViT's 72 zero-padded),
# packed sequences (the LLM's per-document varlen path) included.
#
# flash-attn-4: from $FA4_SITE when set (installed by an earlier run on this machine, e.g.
# FA4_SITE=$HOME/fasite), else installed here into $HOME/fasite from the wheels, split in two parts:
# .fa4a's copied to /tmp/fa4parts by an earlier run, .fa4b in the checkout (the recipe: .fa4a/README.txt).
# CHECK=0 / LOSS=0 skip a part; QUICK=1: 4K instead of 16K sequences, fewer timing runs; STEPS (200);
# WORKLOAD_ONLY=1: our attention paths only, not the raw kernel per head dim (--workload-only).
# Where CHECKED_HEAD_DIMS has no entry for this GPU, the loss runs take the head dims the check passed
# here (MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS, kept in $SITE/checked_head_dims.txt for a later run).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
CU13=nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl
CU13_SHA256=50191a381d8cc1393373ae0bc879b0aefa9a256c23c22d4fa1c2fe3dfe57bc90
SITE=${FA4_SITE:-$HOME/fasite}
if [ -z "${FA4_SITE:-}" ]; then
  cat /tmp/fa4parts/cu13.part.00 .fa4b/cu13.part.01 > "/tmp/fa4parts/$CU13" \
    || { echo "error: the wheel parts are missing: copy .fa4a to /tmp/fa4parts first, then run with .fa4b in the checkout"; exit 2; }
  echo "$CU13_SHA256  /tmp/fa4parts/$CU13" | sha256sum -c --quiet || { echo "error: the joined wheel is corrupt"; exit 2; }
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" /tmp/fa4parts/*.whl || exit 2
fi
if [ -z "${FA4_SITE:-}" ]; then use_fa4 "$SITE"; fi  # with FA4_SITE, gpu_env.sh did
check=0
if [ "${CHECK:-1}" != 0 ]; then
  echo "== $(date +%T) megatron-hetero kernels check attention"
  # The check judges the committed table alone, not head dims an earlier check recorded here.
  env -u MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS MEGATRON_HETERO_KERNEL_CHECKS=/dev/null \
    python3 -m megatron_hetero.cli kernels check attention ${QUICK:+--quick} ${WORKLOAD_ONLY:+--workload-only} \
    --out "$out" > "$out/fa4_check.log" 2>&1; check=$?
  cp "$out/fa4_checked_head_dims.txt" "$SITE/checked_head_dims.txt" 2>/dev/null
  grep -E "\| (auto|flash|sdpa)|FAIL|negative control|CHECKED_HEAD_DIMS|head dims whose|^(PASS|FAIL|error)" \
    "$out/fa4_check.log" | cut -c1-230
  echo "kernels check attention: exit $check"
fi
if [ "${LOSS:-1}" != 0 ]; then
  fa4_checked "$SITE"  # what the check above recorded
  # A GPU-sized model: SigLIP-like ViT (224 px / 14: 256 tokens, 16 heads x 72) into an LLM of 8 heads
  # x 128, two samples packed per 1024-token sequence.
  FLAGS="--hetero-layout examples/layouts/single.yaml --bf16 --train-iters ${STEPS:-200} --global-batch-size 32
    --micro-batch-size 8 --pack-samples 2 --seq-length 1024 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 20
    --log-interval 50 --seed 1234 --image-size 224 --patch-size 14 --enc-hidden-size 1152 --enc-num-layers 4
    --enc-num-attention-heads 16 --hidden-size 1024 --num-attention-heads 8 --num-layers 4"
  # LOSS_ARMS: the runs, each NAME:BACKEND[:SETTING,...], a setting VAR=VALUE (the environment) or
  # --flag=VALUE (one more flag, e.g. --seed=4321); the first two are compared (default SDPA against
  # flash-attn-4; the fused norms and MLP against torch's kernels: LOSS_ARMS="torch:auto:
  # MEGATRON_HETERO_NORM_KERNEL=torch,MEGATRON_HETERO_MLP_KERNEL=torch quack:auto", without the space).
  read -r -a arms <<< "${LOSS_ARMS:-unfused:unfused flash:flash}"
  for arm in "${arms[@]}"; do
    IFS=: read -r name backend settings <<< "$arm"
    read -r -a parts <<< "${settings//,/ }"; envs=(); flags=()
    for part in "${parts[@]}"; do if [[ $part == --* ]]; then flags+=("$part"); else envs+=("$part"); fi; done
    echo "== $(date +%T) pretrain_vlm.py --attention-backend $backend ${parts[*]}" | tee -a "$out/loss_runs.log"
    # shellcheck disable=SC2086
    env "${envs[@]}" torchrun --nproc-per-node 1 examples/pretrain_vlm.py $FLAGS --attention-backend $backend \
      "${flags[@]}" --metrics-file "$out/loss_$name.jsonl" >> "$out/loss_runs.log" 2>&1
    echo "exit $?"; grep -E "^(attention|norms|mlp):|^error" "$out/loss_runs.log" | tail -6
  done
  python3 benchmarks/compare_losses.py "$out/loss_${arms[0]%%:*}.jsonl" "$out/loss_${arms[1]%%:*}.jsonl" \
    | tee -a "$out/loss_runs.log" | grep -E "^\| (1|50|100|150|200) |steps:"
fi
exit $check
