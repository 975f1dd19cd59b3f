"""A layer's residual add after its attention and its MLP (megatron-core's bias-dropout-add, or
InternViT's with layer scale) with no dropout, as one Triton kernel called at an eager op's host cost.

Why: under `--bias-dropout-fusion` (Megatron's default) megatron-core compiles its bias-dropout-add
(torch.compile): one kernel each way, but each call costs the host about 0.2 ms forward and 0.3 ms
backward in the compiled function's wrappers, five times its kernel's time where a ViT's tokens are
few (one H100: docs/results.md, "Where the step waits on the host"), and the GPU waits for them.
Here out = residual + (x + bias) in fp32, rounded once, as the compiled kernel computes it, in one
pass; the backward hands the output's gradient to x and the residual and sums it over the tokens for
the bias (torch's sum). With a layer scale (InternViT: families/internvl/vision.py) out = residual +
(x + bias) * scale, the same way; its backward is one more kernel: x's gradient (the output's times the
scale, rounded once) and each block of rows' fp32 sums for the scale's and the bias's gradients, which
torch adds up (models/column_sums.py).

`MEGATRON_HETERO_RESIDUAL_ADD` (kernel_policy.RESIDUAL_ADD_ENV): auto (the default) or triton: this
kernel where the fusion is asked for and the add has no dropout (evaluation, or a dropout of 0), on a
GPU with Triton, x, bias and residual of one dtype and shape; megatron-core's elsewhere. torch:
megatron-core's bias-dropout-add always. On an H100 the output and x's and the residual's gradients
equal the compiled function's bit for bit (the plain add's and the layer-scale add's; the layer-scale
add's bias gradient within the rounding of a sum's order), the step of Qwen2.5-VL-7B at 6
images ran 0.6% faster, and InternVL3-8B's, with the MLPs' bias-GELU on ours too (models/bias_gelu.py),
1.2% faster (docs/results.md). The layers call the builders (`bias_dropout_add` here, megatron-core's
signature: no config to take the policy from) at each forward, and they read the mode then; the
arguments' check (kernel_policy.build) stops a bad value before training.
"""

import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_hetero.models import column_sums
from megatron_hetero.models.accelerators import has_triton
from megatron_hetero.models.kernel_policy import mode_now

HAVE_TRITON = has_triton()
BLOCK = 1024  # elements per program of the forward kernel

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from megatron_hetero.models.column_sums import tile

    @triton.jit
    def _residual_add_kernel(x, bias, scale, residual, out, n, width, HAS_BIAS: tl.constexpr,
                             HAS_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        """out = residual + (x + bias) [* scale] over n elements of rows `width` long, in fp32."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        total = tl.load(x + offsets, mask=mask).to(tl.float32)
        if HAS_BIAS:
            total += tl.load(bias + offsets % width, mask=mask).to(tl.float32)
        if HAS_SCALE:
            total = tl.load(residual + offsets, mask=mask).to(tl.float32) + total * tl.load(
                scale + offsets % width, mask=mask).to(tl.float32)
        else:
            total = tl.load(residual + offsets, mask=mask).to(tl.float32) + total
        tl.store(out + offsets, total.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _scaled_backward_kernel(grad, x, bias, scale, dx, scale_sums, bias_sums, rows, width,
                                HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """dx = grad * scale; this tile's fp32 sums over its rows of grad * (x + bias) and of grad * scale
        (column_sums)."""
        offsets, mask, column, in_width, sums = tile(rows, width, ROWS, COLUMNS)
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        scaled = g * tl.load(scale + column, mask=in_width, other=0.0).to(tl.float32)[None, :]
        tl.store(dx + offsets, scaled.to(dx.dtype.element_ty), mask=mask)
        total = tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            total += tl.load(bias + column, mask=in_width, other=0.0).to(tl.float32)[None, :]
        tl.store(scale_sums + sums, tl.sum(g * total, axis=0), mask=in_width)
        tl.store(bias_sums + sums, tl.sum(scaled, axis=0), mask=in_width)


class _ResidualAdd(torch.autograd.Function):
    """forward: residual + (x + bias) [* scale] (bias None: no bias; scale None: no scale), one kernel;
    backward: the gradient to the residual as it is; to x as it is, or times the scale, with the scale's
    and the bias's sums over the tokens (one more kernel with the scale; torch's sum without)."""

    @staticmethod
    def forward(ctx, x, bias, residual, scale):
        out = torch.empty_like(residual)
        n = out.numel()
        _residual_add_kernel[(triton.cdiv(n, BLOCK),)](
            x, x if bias is None else bias, x if scale is None else scale, residual, out, n, out.shape[-1],
            HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, BLOCK=BLOCK)
        ctx.scaled = scale is not None
        if ctx.scaled:
            ctx.save_for_backward(x, bias, scale)
        return out

    @staticmethod
    def backward(ctx, grad):
        if not ctx.scaled:
            bias_grad = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
            return grad, bias_grad, grad, None
        x, bias, scale = ctx.saved_tensors
        dx, (scale_sum, bias_sum) = column_sums.backward(
            _scaled_backward_kernel, grad, (x, scale if bias is None else bias, scale), sums=2,
            HAS_BIAS=bias is not None)
        bias_grad = bias_sum.to(bias.dtype) if ctx.needs_input_grad[1] else None
        return dx, bias_grad, grad, scale_sum.to(scale.dtype) if ctx.needs_input_grad[3] else None


def residual_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    """residual + (x + bias) [* scale] on the kernel (tensors that `takes`)."""
    return _ResidualAdd.apply(x, bias, residual, scale)


def takes(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
          scale: torch.Tensor | None = None) -> bool:
    """Whether the kernel adds these: contiguous x and residual of one shape and dtype on a GPU, the bias
    and the scale (if any) one value per column in that dtype."""
    return (HAVE_TRITON and x.is_cuda and x.shape == residual.shape and x.dtype == residual.dtype
            and x.is_contiguous() and residual.is_contiguous() and column_sums.per_column(bias, x)
            and column_sums.per_column(scale, x))


def mode() -> str:
    """MEGATRON_HETERO_RESIDUAL_ADD's mode, read when a layer's forward builds its add."""
    return mode_now("residual_add")


def kernel_adds(mode: str, training: bool, prob: float, x: torch.Tensor, bias: torch.Tensor | None,
                residual: torch.Tensor, scale: torch.Tensor | None = None) -> bool:
    """Whether the fused add of these runs on the kernel under `mode`: not under torch; nothing dropped
    (evaluation, or a dropout of 0); tensors the kernel `takes`."""
    return mode != "torch" and not (training and prob > 0) and takes(x, bias, residual, scale)


def bias_dropout_add(training: bool, fused: bool):
    """megatron-core's get_bias_dropout_add (a layer's `self_attn_bda` / `mlp_bda`, called with
    `training` and --bias-dropout-fusion), with the fused add on this kernel where it takes the call,
    unless the torch mode asks for megatron-core's."""
    upstream = get_bias_dropout_add(training, fused)
    chosen = mode()
    if not fused or chosen == "torch":
        return upstream

    def add(x_with_bias, residual, prob):
        x, bias = x_with_bias
        if not kernel_adds(chosen, training, prob, x, bias, residual):
            return upstream(x_with_bias, residual, prob)
        return residual_add(x, bias, residual)
    return add
