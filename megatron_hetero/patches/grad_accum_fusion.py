"""Gradient-accumulation fusion without apex (megatron-core 0.19 `tensor_parallel.layers` and
`utils.drain_embedding_wgrad_compute` import apex's `fused_weight_gradient_mlp_cuda`).

With `gradient_accumulation_fusion` (Megatron's default; --no-gradient-accumulation-fusion turns it
off) megatron-core's linear layers accumulate a weight gradient into the parameter's main_grad (the
DDP buffer, fp32 under --bf16) inside the weight-gradient GEMM. Without apex the flag had to be off:
each weight gradient was then written in bf16 and added to main_grad by DDP's hook, another pass
over it in fp32. torch's GEMM takes an output dtype (bf16 inputs, an fp32 output accumulated with
beta 1), the same operation as apex's kernel: this patch gives megatron-core that, as the module it
imports, where apex is missing. W1 on one H200: docs/runs/benchmarks.md.
"""

import types

import torch

from megatron_hetero.patches._patch import provide_module, set_value

MODULE = "fused_weight_gradient_mlp_cuda"


def accumulate_wgrad(input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """main_grad [out, in] += grad_output [tokens, out]^T @ input [tokens, in], accumulated by the
    GEMM in main_grad's dtype (apex's wgrad_gemm_accum_fp32 / _fp16)."""
    if input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), input)
    else:
        # torch has this GEMM on GPUs only; --bf16 (the only mixed case) is refused on CPUs.
        torch.addmm(main_grad, grad_output.t(), input, out_dtype=main_grad.dtype, out=main_grad)


def apply() -> None:
    from megatron.core.tensor_parallel import layers

    if layers._grad_accum_fusion_available:  # apex's own kernel (or this patch's, applied already)
        return
    module = types.ModuleType(MODULE, "megatron-hetero: apex's weight-gradient accumulation on torch's GEMM")
    module.wgrad_gemm_accum_fp32 = module.wgrad_gemm_accum_fp16 = accumulate_wgrad
    provide_module(MODULE, module)  # utils.drain_embedding_wgrad_compute imports it by name
    owner = "megatron.core.tensor_parallel.layers"
    set_value(f"{owner}.{MODULE}", module, types.ModuleType, create=True)
    set_value(f"{owner}._grad_accum_fusion_available", True, bool)
