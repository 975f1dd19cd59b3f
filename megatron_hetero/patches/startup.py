"""What stops Megatron-LM's own scripts before training when only the megatron-core wheel is installed
(no Transformer Engine, no apex). Targets megatron-core 0.19 / megatron.training 0.19:
- `_compile_dependencies` runs `make` in megatron/core/datasets, which the wheel ships without a
  Makefile but with the compiled `helpers_cpp`: use it when it imports;
- `initialize_megatron` asserts CUDA unless `allow_no_cuda`: allowed when no GPU is present;
- the local spec's fused kernels (persistent layer norm, bias-gelu/swiglu fusion, masked softmax) need
  apex or TE: without them the flags default off (gradient-accumulation fusion stays:
  grad_accum_fusion.py runs it on torch's GEMM); the bias-dropout-add fusion is megatron-core's own
  torch.compile'd function and stays on GPUs (on CPUs it would build C++ kernels per layer shape for
  no speed: off there);
- CLIPViTModel builds `ln_pre` from torch's LayerNorm when TE is absent and passes it `config=`:
  megatron-core's WrappedTorchNorm takes that signature;
- megatron.training's validate_args stops every run with TP or CP on GPUs before Blackwell unless
  `CUDA_DEVICE_MAX_CONNECTIONS=1` is in the environment (one connection keeps the order in which
  kernels are launched, which its overlap of TP/CP communication with compute relies on): set where
  unset, before CUDA starts, with one line saying so (`set_cuda_connections`, the first thing
  `apply()` does, so every script that applies the plugin gets it, launcher or not).
"""

import os

import torch

from megatron_hetero.models.accelerators import has_apex, has_te
from megatron_hetero.patches._patch import PASS_THROUGH, replace

FUSION_FLAGS = ("persist_layer_norm", "bias_gelu_fusion", "bias_swiglu_fusion", "masked_softmax_fusion")
COMPILED_FUSION_FLAGS = ("bias_dropout_fusion",)  # megatron-core's torch.compile'd kernels: GPUs only


CUDA_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"


def set_cuda_connections(gpus: bool | None = None) -> str | None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 where the environment lacks it; the notice printed on GPUs (rank
    0; on CPUs the variable changes nothing), or None where nothing was set."""
    if CUDA_CONNECTIONS in os.environ:
        return None
    os.environ[CUDA_CONNECTIONS] = "1"
    if not (torch.cuda.is_available() if gpus is None else gpus):
        return None
    late = " (CUDA had started in this process already: export it before Python starts)" \
        if torch.cuda.is_initialized() else ""
    notice = (f"megatron-hetero: set {CUDA_CONNECTIONS}=1, which Megatron needs with TP or CP on GPUs before "
              f"Blackwell{late}; export another value to override")
    if int(os.environ.get("RANK", "0")) == 0:
        print(notice, flush=True)
    return notice


def _compile_helpers(original):
    def compile_helpers():
        try:
            from megatron.core.datasets import helpers_cpp  # noqa: F401  (shipped compiled)
        except ImportError:
            original()
    return compile_helpers


def _initialize_megatron(original):
    def initialize_megatron(*args, **kwargs):
        if not torch.cuda.is_available():
            kwargs["allow_no_cuda"] = True
        return original(*args, **kwargs)
    return initialize_megatron


def disable_unavailable_fusions(args, gpus: bool | None = None) -> None:
    """Fused kernels that need apex or TE default off without them, torch.compile'd ones without a GPU
    (the user's flags are kept where the kernels exist)."""
    flags = () if has_apex() or has_te() else FUSION_FLAGS
    if not (torch.cuda.is_available() if gpus is None else gpus):
        flags += COMPILED_FUSION_FLAGS
    for flag in flags:
        if getattr(args, flag, False):
            setattr(args, flag, False)
    if "persist_layer_norm" in flags:
        args.no_persist_layer_norm = True


def _clip_init(original):
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def __init__(self, *args, **kwargs):
        if not has_te():
            kwargs.setdefault("ln_pre_impl", WrappedTorchNorm)
        original(self, *args, **kwargs)
    return __init__


def apply() -> None:
    replace("megatron.core.datasets.utils.compile_helpers", _compile_helpers, PASS_THROUGH)
    replace("megatron.training.training.initialize_megatron", _initialize_megatron, params=("allow_no_cuda",))
    replace("megatron.core.models.vision.clip_vit_model.CLIPViTModel.__init__", _clip_init,
            params=("ln_pre_impl",))
