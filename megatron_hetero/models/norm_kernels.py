"""Which kernels a LayerNorm / RMSNorm runs: torch's everywhere, quack's (quack-kernels, installed
with the `fa4` extra, which flash-attn-4 itself depends on) on Hopper and Blackwell GPUs where it
imports.

Why: torch's norm backward makes two passes over the activations, the input gradient and then
GammaBetaBackward for the weight and bias gradients: in W1's profiled step on one H200 (8 LLM
layers, global batch 16; docs/runs/benchmarks.md) the forward took 63 ms, the input gradient 63 and the
weight and bias gradients 71 more. quack's backward computes the weight and bias gradients in the
input gradient's pass, as fp32 partial sums per SM added up afterwards (what apex's and Transformer
Engine's fused norms do, neither of which is here). The statistics are fp32 in both.

`MEGATRON_HETERO_NORM_KERNEL` (NORM_KERNEL_ENV): auto (the default: quack where it can run for calls of
NORM_MIN_ELEMENTS or more, torch elsewhere), torch (torch's kernels on every device: A/B runs, or a
suspected kernel) or quack (every call where it can run); the rule is
quack_kernels.py's, shared with the MLP's GEMMs; norm_kernel_for(policy) feeds it the layer's kernel
policy (kernel_policy.of(config)) and this process's GPU. The calls quack does not take run torch's
kernels, or ours under MEGATRON_HETERO_SMALL_NORM=triton (small_norm.py).
`megatron-hetero kernels check norms` checks quack's outputs and gradients against fp32 at the workloads' widths on
a GPU.
"""

import functools
from typing import Callable, NamedTuple

import torch

from megatron_hetero.models.attention_kernels import import_failure
from megatron_hetero.models.kernel_policy import NORM_KERNEL_ENV, KernelPolicy
from megatron_hetero.models.quack_kernels import QuackChoice, quack_kernel_for

# Under auto, quack for a norm call of >= 2^24 elements (quack_kernels.py: why): W1's and W3's ViT
# norms (23,328 x 1152, 2^24.7) and every LLM's of the workloads run quack; the loss model's (8,192 x
# 1024, 2^23) torch.
NORM_MIN_ELEMENTS = (2**24, "elements")


class Quack(NamedTuple):
    """quack's norm entries (quack.rmsnorm's, the ones its own autograd functions call): fwd writes
    out, rstd and (LayerNorm) mean; bwd writes dx and the per-SM partial weight / bias gradients;
    sm_count(hidden, device): how many partials bwd writes."""

    fwd: Callable
    bwd: Callable
    sm_count: Callable


@functools.cache
def load_quack() -> tuple[Quack | None, str | None]:
    """(quack's norm entries, None), or (None, why they do not import)."""
    try:
        from quack.rmsnorm import _rmsnorm_bwd, _rmsnorm_fwd, get_sm_count
    except Exception as error:  # ImportError, or the CuTe DSL failing to load its libraries
        return None, import_failure("quack", error)
    return Quack(_rmsnorm_fwd, _rmsnorm_bwd, get_sm_count), None


def norm_kernel_for(policy: KernelPolicy) -> QuackChoice:
    """The kernel of norms under `policy` (its norm mode) on this process's GPU."""
    return quack_kernel_for(NORM_KERNEL_ENV, policy.norm, load_quack, NORM_MIN_ELEMENTS)


class _QuackNorm(torch.autograd.Function):
    """quack's LayerNorm (bias may be None) or RMSNorm (bias None) over the last dim of a 2-D x.

    forward: y = (x - mean) * rstd * weight + bias (RMSNorm: x * rstd * weight), fp32 statistics kept;
    with pass_residual also x itself (the layer's residual);
    backward: dx, and the weight and bias gradients from the same pass (per-SM fp32 partials, summed
    here and cast to the parameters' dtypes); the residual's gradient added into dx by the kernel."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, quack, pass_residual):
        rows = x.shape[0]
        out = torch.empty_like(x)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        mean = None if rms else torch.empty(rows, device=x.device, dtype=torch.float32)
        quack.fwd(x, weight, out, bias, rstd, mean, None, None, eps, not rms)
        ctx.save_for_backward(x, weight, rstd, mean)
        ctx.has_bias, ctx.bias_dtype, ctx.quack = bias is not None, getattr(bias, "dtype", None), quack
        ctx.set_materialize_grads(False)
        return (out, x) if pass_residual else out

    @staticmethod
    def backward(ctx, dout, dresidual=None):
        x, weight, rstd, mean = ctx.saved_tensors
        hidden, partials = x.shape[-1], ctx.quack.sm_count(x.shape[-1], x.device)
        dout = torch.zeros_like(x) if dout is None else dout.contiguous()
        dx = torch.empty_like(x)
        # quack writes nothing for no rows: the partials start at zero there.
        empty = torch.zeros if x.numel() == 0 else torch.empty
        dw = empty(partials, hidden, device=x.device, dtype=torch.float32)
        db = empty(partials, hidden, device=x.device, dtype=torch.float32) if ctx.has_bias else None
        dresidual = None if dresidual is None else dresidual.to(x.dtype).contiguous()
        ctx.quack.bwd(x, weight, dout, rstd, dx, dw, db, dresidual, None, partials, mean=mean,
                      is_layernorm=mean is not None)
        db = db.sum(0).to(ctx.bias_dtype) if db is not None else None
        return dx, dw.sum(0).to(weight.dtype), db, None, None, None, None


def quack_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               rms: bool, quack: Quack, pass_residual: bool = False):
    """LayerNorm (rms False; bias may be None) or RMSNorm of x over its last dim on quack's kernels,
    any leading shape; with pass_residual (output, x), x's two gradients summed in the backward."""
    flat = x.contiguous().view(-1, x.shape[-1])
    if not pass_residual:
        return _QuackNorm.apply(flat, weight, bias, eps, rms, quack, False).view(x.shape)
    out, residual = _QuackNorm.apply(flat, weight, bias, eps, rms, quack, True)
    return out.view(x.shape), residual.view(x.shape)
