"""A layer's residual add after its attention and its MLP (megatron-core's bias-dropout-add) with no
dropout, as one Triton kernel called at an eager op's host cost.

Why: under `--bias-dropout-fusion` (Megatron's default) megatron-core compiles its bias-dropout-add
(torch.compile): one kernel each way, but each call costs the host about 0.2 ms forward and 0.3 ms
backward in the compiled function's wrappers, five times its kernel's time where a ViT's tokens are
few (one H100: docs/results.md, "Where the step waits on the host"), and the GPU waits for them.
Here out = residual + (x + bias) in fp32, rounded once, as the compiled kernel computes it, in one
pass; the backward hands the output's gradient to x and the residual and sums it over the tokens for
the bias (torch's sum).

`MEGATRON_HETERO_RESIDUAL_ADD` (kernel_policy.RESIDUAL_ADD_ENV): auto (the default) or triton: this
kernel where the fusion is asked for and the add has no dropout (evaluation, or a dropout of 0), on a
GPU with Triton, x, bias and residual of one dtype and shape; megatron-core's elsewhere. torch:
megatron-core's bias-dropout-add always. On an H100 its output and input gradients equal the compiled
function's bit for bit, and the step of Qwen2.5-VL-7B at 6 images took 0.6% less time (docs/results.md).
The layers call the builder (`bias_dropout_add`, megatron-core's signature: no config to take the
policy from) at each forward, and it reads the mode then; the arguments' check (kernel_policy.build)
stops a bad value before training.
"""

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_hetero.models.accelerators import has_triton
from megatron_hetero.models.kernel_policy import RESIDUAL_ADD_ENV, RESIDUAL_ADD_MODES, kernel_mode

HAVE_TRITON = has_triton()
BLOCK = 1024  # elements per program of the kernel below

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _residual_add_kernel(x, bias, residual, out, n, width, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
        """out = residual + (x + bias) over n elements of rows `width` long, in fp32."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        total = tl.load(x + offsets, mask=mask).to(tl.float32)
        if HAS_BIAS:
            total += tl.load(bias + offsets % width, mask=mask).to(tl.float32)
        total = tl.load(residual + offsets, mask=mask).to(tl.float32) + total
        tl.store(out + offsets, total.to(out.dtype.element_ty), mask=mask)


class _ResidualAdd(torch.autograd.Function):
    """forward: residual + (x + bias) (bias None: residual + x), one kernel;
    backward: the gradient to x and to the residual as it is, summed over the tokens for the bias."""

    @staticmethod
    def forward(ctx, x, bias, residual):
        out = torch.empty_like(residual)
        n = out.numel()
        _residual_add_kernel[(triton.cdiv(n, BLOCK),)](x, x if bias is None else bias, residual, out, n,
                                                       out.shape[-1], HAS_BIAS=bias is not None, BLOCK=BLOCK)
        return out

    @staticmethod
    def backward(ctx, grad):
        bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        return grad, bias_grad, grad


def residual_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
    """residual + (x + bias) on the kernel (tensors that `takes`)."""
    return _ResidualAdd.apply(x, bias, residual)


def takes(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> bool:
    """Whether the kernel adds these: contiguous x and residual of one shape and dtype on a GPU, the bias
    (if any) one value per column in that dtype."""
    return (HAVE_TRITON and x.is_cuda and x.shape == residual.shape and x.dtype == residual.dtype
            and x.is_contiguous() and residual.is_contiguous()
            and (bias is None or (bias.shape == x.shape[-1:] and bias.dtype == x.dtype and bias.is_contiguous())))


def bias_dropout_add(training: bool, fused: bool):
    """megatron-core's get_bias_dropout_add (a layer's `self_attn_bda` / `mlp_bda`, called with
    `training` and --bias-dropout-fusion), with the fused add on this kernel where it takes the call,
    unless the torch mode asks for megatron-core's."""
    upstream = get_bias_dropout_add(training, fused)
    if not fused or kernel_mode(RESIDUAL_ADD_ENV, modes=RESIDUAL_ADD_MODES) == "torch":
        return upstream

    def add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if (training and prob > 0) or not takes(x, bias, residual):
            return upstream(x_with_bias, residual, prob)
        return residual_add(x, bias, residual)
    return add
