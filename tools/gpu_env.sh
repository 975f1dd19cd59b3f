# Sourced by the tools/gpu_*_run.sh scripts: NCCL/PyTorch settings, this checkout's megatron_hetero
# (the tools import it), megatron-core from .whl/ when carried there, $out for results, and the
# hardware line.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
# megatron-core asserts it for TP/CP on pre-Blackwell GPUs (one stream orders TP communication and compute).
export CUDA_DEVICE_MAX_CONNECTIONS=1
# This checkout's package (megatron_hetero/__init__.py makes patches/ its megatron_hetero.patches).
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
out=${OUT:-out}; mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/hardware.txt"
