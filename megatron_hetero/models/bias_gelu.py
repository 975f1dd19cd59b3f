"""fc1's bias add and erf GELU of a dense MLP that megatron-core's forward runs (models/mlp.py: calls
below quack's minimum, e.g. InternViT's), as one Triton kernel each way called at an eager op's host cost.

Why: under `--bias-dropout-fusion` models/mlp.py compiles the bias add and activation (torch.compile):
one kernel each way, but each call costs the host about 0.27 ms forward and 0.39 ms backward in the
compiled function's wrappers, where InternViT-300M's kernels take 0.09 and 0.13 ms (one H100:
docs/results.md, "InternVL3-8B with the residual add on the kernel"). Here y = gelu(x + bias) in fp32,
rounded once, in the arithmetic of torch's own decomposition (0.5 v (1 + erf(v / sqrt 2))); the backward recomputes
v = x + bias and gives x's gradient, grad (cdf(v) + v pdf(v)) rounded once, and each block of rows' fp32
sums of it for the bias, which torch adds up (models/column_sums.py).

`MEGATRON_HETERO_BIAS_GELU` (kernel_policy.BIAS_GELU_ENV): auto (the default) or triton: this kernel for
erf GELU on a GPU with Triton, x and bias of one dtype, contiguous; the compiled function elsewhere.
torch: the compiled function always. On an H100 the output equals the compiled function's bit for bit,
the gradients differ by rounding (bf16 at InternViT's widths: x's by at most 0.002, the bias's, sums of
some 10^4 rows, by at most 1.0), and InternVL3-8B's step, with InternViT's layer-scale add on our kernel
too (models/residual_add.py), ran 1.2% faster (docs/results.md).
"""

import math

import torch
import torch.nn.functional as F

from megatron_hetero.models import column_sums
from megatron_hetero.models.accelerators import has_triton
from megatron_hetero.models.kernel_policy import mode_now

HAVE_TRITON = has_triton()
BLOCK = 1024  # elements per program of the forward kernel

if HAVE_TRITON:
    import triton
    import triton.language as tl

    from megatron_hetero.models.column_sums import tile

    SQRT1_2 = tl.constexpr(1 / math.sqrt(2))
    PDF_SCALE = tl.constexpr(2 / math.sqrt(math.pi) * (1 / math.sqrt(2)) * 0.5)  # 1 / sqrt(2 pi), as torch writes it

    @triton.jit
    def _bias_gelu_kernel(x, bias, out, n, width, BLOCK: tl.constexpr):
        """out = gelu(x + bias) (erf) over n elements of rows `width` long, in fp32."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        v = tl.load(x + offsets, mask=mask).to(tl.float32) + tl.load(bias + offsets % width, mask=mask).to(tl.float32)
        y = 0.5 * v * (1 + tl.math.erf(v * SQRT1_2))
        tl.store(out + offsets, y.to(out.dtype.element_ty), mask=mask)

    @triton.jit
    def _bias_gelu_backward_kernel(grad, x, bias, dx, bias_sums, rows, width, ROWS: tl.constexpr,
                                   COLUMNS: tl.constexpr):
        """dx = grad * gelu'(x + bias); this tile's fp32 sums of it over its rows (column_sums)."""
        offsets, mask, column, in_width, sums = tile(rows, width, ROWS, COLUMNS)
        v = (tl.load(x + offsets, mask=mask, other=0.0).to(tl.float32)
             + tl.load(bias + column, mask=in_width, other=0.0).to(tl.float32)[None, :])
        cdf = 0.5 * (1 + tl.math.erf(v * SQRT1_2))
        pdf = PDF_SCALE * tl.exp(v * v * -0.5)
        d = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32) * (cdf + v * pdf)
        tl.store(dx + offsets, d.to(dx.dtype.element_ty), mask=mask)
        tl.store(bias_sums + sums, tl.sum(d, axis=0), mask=in_width)


class _BiasGelu(torch.autograd.Function):
    """forward: gelu(x + bias), one kernel; backward: x's gradient and the bias's sums, one kernel and
    torch's sum over the blocks of rows."""

    @staticmethod
    def forward(ctx, x, bias):
        out = torch.empty_like(x)
        n = out.numel()
        _bias_gelu_kernel[(triton.cdiv(n, BLOCK),)](x, bias, out, n, out.shape[-1], BLOCK=BLOCK)
        ctx.save_for_backward(x, bias)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, bias = ctx.saved_tensors
        dx, (bias_sum,) = column_sums.backward(_bias_gelu_backward_kernel, grad, (x, bias), sums=1)
        return dx, bias_sum.to(bias.dtype) if ctx.needs_input_grad[1] else None


def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """gelu(x + bias) (erf) on the kernel (tensors that `takes`)."""
    return _BiasGelu.apply(x, bias)


def chosen(activation) -> bool:
    """Whether the mode puts this activation's fused bias add on the kernel: erf GELU unless the mode is
    torch, where Triton imports (the mode is read at each call, a dictionary lookup)."""
    return (HAVE_TRITON and activation is F.gelu
            and mode_now("bias_gelu") != "torch")


def takes(x: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernel takes these: contiguous x on a GPU, the bias one contiguous value per column in
    x's dtype."""
    return x.is_cuda and x.is_contiguous() and bias is not None and column_sums.per_column(bias, x)


def runs_kernel(x: torch.Tensor, bias: torch.Tensor | None, activation) -> bool:
    """Whether activation(x + bias), fused, runs on the kernel."""
    return chosen(activation) and takes(x, bias)
