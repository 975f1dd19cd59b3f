# Sourced by the tools/gpu_*_run.sh scripts: NCCL/PyTorch settings, this checkout's megatron_hetero
# installed as users install it (the tools import it), megatron-core from .whl/ when carried there,
# flash-attn-4 from $FA4_SITE when set,
# $out for results, and the hardware line. (CUDA_DEVICE_MAX_CONNECTIONS=1, which Megatron wants for
# TP/CP on pre-Blackwell GPUs, the plugin sets itself where unset: patches/startup.py.)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore

# install_checkout DIR TARGET: the checkout at DIR built and installed into TARGET, offline; put TARGET
# on PYTHONPATH to use it.
install_checkout() {
  # One build at a time: pip builds a local tree in its own build/ folder, which scripts started side by
  # side (SITE_TAG) would share.
  rm -rf "$2" && flock /tmp/megatron_hetero_install.lock \
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --target "$2" "$1"
}
# baseline_checkout REV: an A/B script's baseline installed beside this checkout: `base` its tree (BASE_DIR,
# default .base, made here with `rm -rf .base && mkdir .base && git archive REV | tar -x -C .base`,
# ignored in .git/info/exclude and carried; else a git worktree of REV where the device copy has .git),
# BASE_PATH the PYTHONPATH that imports it instead of this checkout.
baseline_checkout() {
  base=$(realpath "${BASE_DIR:-.base}" 2>/dev/null)
  if [ ! -f "$base/setup.py" ]; then
    base=/tmp/ab_base && rm -rf $base
    git worktree add --detach $base "$1" >/dev/null 2>&1 \
      || { echo "error: no baseline tree: carry .base (git archive $1) or run where .git is"; return 2; }
  fi
  install_checkout "$base" "$SITE-base" || return 2
  BASE_PATH=${PYTHONPATH/$SITE/$SITE-base}
}
# SITE_TAG: a name of this script's own installs, for scripts run side by side on one machine.
SITE=/tmp/megatron_hetero_site${SITE_TAG:+-$SITE_TAG}
install_checkout "$PWD" "$SITE" || exit 1
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then  # once per machine: scripts side by side share it
  [ -d /tmp/site/megatron ] || flock /tmp/megatron_hetero_install.lock python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
out=${OUT:-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/hardware.txt"
# use_fa4 SITE: flash-attn-4 installed into SITE by benchmarks/gpu_fa4_check.sh (pip's --target, which skips
# the DSL's .pth file) importable, with the head dims that script checked on this machine
# (fa4_checked: where it recorded them); done here for every script where FA4_SITE names it.
fa4_checked() {
  if [ -f "$1/checked_head_dims.txt" ]; then
    export MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS=$(cat "$1/checked_head_dims.txt")
  fi
}
use_fa4() {
  # quack keys its GEMM epilogues' compiled kernels by walking their code and stops at installed code,
  # which it knows by a site-packages directory in the path (models/mlp_kernels.py): import SITE
  # through a link named so, or every epilogue GEMM refuses to compile.
  mkdir -p /tmp/fa4_import && ln -sfn "$(realpath "$1")" /tmp/fa4_import/site-packages
  local site=/tmp/fa4_import/site-packages
  export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
  fa4_checked "$1"
}
if [ -n "${FA4_SITE:-}" ]; then use_fa4 "$FA4_SITE"; fi
# mlm_vlm_flags ITERS GLOBAL_BATCH: Megatron-LM's pretrain_vlm.py at a small size (4-layer CLIP ViT,
# 8-layer LLM of width 1024, mock data), every iteration logged (gpu2_megatron_run.sh, gpu4_exactness_run.sh).
mlm_vlm_flags() {
  echo "--encoder-num-layers 4 --decoder-num-layers 8 --hidden-size 1024 --num-attention-heads 16
  --seq-length 576 --decoder-seq-length 1024 --max-position-embeddings 2048 --img-h 336 --img-w 336
  --patch-dim 14 --micro-batch-size 4 --global-batch-size $2 --train-iters $1 --eval-interval 100000
  --eval-iters 0 --lr 1e-4 --mock-data --tokenizer-type NullTokenizer --vocab-size 32000
  --transformer-impl local --num-workers 2 --log-interval 1 --ckpt-format torch"
}
