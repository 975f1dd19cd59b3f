"""LayerNorm / RMSNorm calls below quack's minimum (models/norm_kernels.py: NORM_MIN_ELEMENTS; e.g. the
ViTs' norms at some thousand tokens a call: InternViT-300M's, Qwen2.5-VL's at 6 images a sample) on Triton
kernels: one each way, the weight and bias gradients and the residual's gradient in the input gradient's
pass.

Why: there torch's kernels run, whose backward makes three passes over the activations: the input
gradient, then GammaBetaBackward for the weight and bias gradients, then autograd's add of the
residual's gradient (the layer's input feeds the norm and the residual add). In Qwen2.5-VL-7B's profiled
step at 6 images on one H100 (docs/results.md, "The packed ViTs' attention input on one Triton kernel")
the ViT's 260 norm backward calls took 21.7 ms and the adds 5.8 ms; here one pass reads x and the two
gradients and writes x's once. quack's fused norms do the same, but cost the host more a call than such
calls take on the GPU.

Forward: one program a row, the statistics in fp32 (RMSNorm: x rstd w; LayerNorm: (x - mean) rstd w + b),
rounded once, rstd (and mean) kept. Backward: each program takes ROWS rows: with xhat the normalized
row and g = w dy, dx = rstd (g - mean(g xhat) xhat) (LayerNorm: also - mean(g)), plus the residual's
gradient, rounded once; the block's fp32 sums of dy xhat and dy for the weight's and the bias's
gradients, which torch adds up.

`MEGATRON_HETERO_SMALL_NORM` (kernel_policy.SMALL_NORM_ENV, the layer's policy): auto (the default) and
torch: torch's kernels for the calls quack does not take; triton: these kernels for them on a GPU with
Triton where the call `takes` (a contiguous x, parameters of one dtype, hidden up to MAX_HIDDEN). On an
H100 these do 28% less GPU work than torch's at such calls, but cost the host more than twice as much a
call (an autograd Function, allocations and a Triton launch each way, the blocks' sums after it), and
InternVL3-8B's step, whose ViT norms are all such calls, ran 2.7% slower on them (docs/results.md, "Our
Triton kernels checked on an H100"): auto keeps torch's.
"""

import torch

from megatron_hetero.models.accelerators import has_triton

HAVE_TRITON = has_triton()
ROWS = 8  # rows a backward program sums the parameters' gradients over: a few programs an SM at a ViT's rows
MAX_HIDDEN = 16384

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _norm_kernel(x, weight, bias, out, rstd, mean, hidden, eps, BLOCK: tl.constexpr, RMS: tl.constexpr,
                     HAS_BIAS: tl.constexpr):
        """One row: out = xhat * weight (+ bias), xhat = (x - mean) * rstd (RMSNorm: x * rstd), in fp32."""
        row = tl.program_id(0).to(tl.int64)
        column = tl.arange(0, BLOCK)
        inside = column < hidden
        v = tl.load(x + row * hidden + column, mask=inside, other=0.0).to(tl.float32)
        if not RMS:
            mu = tl.sum(v, axis=0) / hidden
            tl.store(mean + row, mu)
            v = tl.where(inside, v - mu, 0.0)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / hidden + eps)
        tl.store(rstd + row, r)
        y = v * r * tl.load(weight + column, mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y += tl.load(bias + column, mask=inside, other=0.0).to(tl.float32)
        tl.store(out + row * hidden + column, y.to(out.dtype.element_ty), mask=inside)

    @triton.jit
    def _norm_backward_kernel(x, weight, dout, dresidual, rstd, mean, dx, weight_sums, bias_sums, rows, hidden,
                              BLOCK: tl.constexpr, ROWS: tl.constexpr, RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                              HAS_RESIDUAL: tl.constexpr):
        """ROWS rows: dx (plus the residual's gradient), rounded once; this block's fp32 sums of dout xhat and
        of dout, one row of weight_sums and of bias_sums."""
        block = tl.program_id(0).to(tl.int64)
        column = tl.arange(0, BLOCK)
        inside = column < hidden
        w = tl.load(weight + column, mask=inside, other=0.0).to(tl.float32)
        weight_sum = tl.zeros((BLOCK,), dtype=tl.float32)
        bias_sum = tl.zeros((BLOCK,), dtype=tl.float32)
        for i in range(ROWS):
            row = block * ROWS + i
            mask = inside & (row < rows)
            at = row * hidden + column
            r = tl.load(rstd + row, mask=row < rows, other=0.0)
            xhat = tl.load(x + at, mask=mask, other=0.0).to(tl.float32)
            if not RMS:
                xhat = tl.where(mask, xhat - tl.load(mean + row, mask=row < rows, other=0.0), 0.0)
            xhat = xhat * r
            g = tl.load(dout + at, mask=mask, other=0.0).to(tl.float32)
            wg = w * g
            d = wg - xhat * (tl.sum(xhat * wg, axis=0) / hidden)
            if not RMS:
                d -= tl.sum(wg, axis=0) / hidden
            d *= r
            if HAS_RESIDUAL:
                d += tl.load(dresidual + at, mask=mask, other=0.0).to(tl.float32)
            tl.store(dx + at, d.to(dx.dtype.element_ty), mask=mask)
            weight_sum += g * xhat
            bias_sum += g
        tl.store(weight_sums + block * hidden + column, weight_sum, mask=inside)
        if HAS_BIAS:
            tl.store(bias_sums + block * hidden + column, bias_sum, mask=inside)


class _SmallNorm(torch.autograd.Function):
    """LayerNorm (bias may be None) or RMSNorm over the last dim of a 2-D x.

    forward: the normalized x times the weight, plus the bias, fp32 statistics kept (one kernel); with
    pass_residual also x itself (the layer's residual);
    backward: dx with the residual's gradient added, and the weight's and bias's gradients from the same
    pass (one kernel, and torch's sum over the blocks of rows)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, rms, pass_residual):
        rows, hidden = x.shape
        out = torch.empty_like(x)
        rstd = torch.empty(rows, device=x.device, dtype=torch.float32)
        mean = rstd if rms else torch.empty_like(rstd)
        block = triton.next_power_of_2(hidden)
        _norm_kernel[(rows,)](x, weight, weight if bias is None else bias, out, rstd, mean, hidden, eps,
                              BLOCK=block, RMS=rms, HAS_BIAS=bias is not None)
        ctx.save_for_backward(x, weight, rstd, mean)
        ctx.rms, ctx.bias_dtype = rms, getattr(bias, "dtype", None)
        ctx.set_materialize_grads(False)
        return (out, x) if pass_residual else out

    @staticmethod
    def backward(ctx, dout, dresidual=None):
        x, weight, rstd, mean = ctx.saved_tensors
        rows, hidden = x.shape
        dout = torch.zeros_like(x) if dout is None else dout.contiguous()
        dx = torch.empty_like(x)
        blocks = triton.cdiv(rows, ROWS)
        weight_sums = torch.empty(blocks, hidden, device=x.device, dtype=torch.float32)
        has_bias = ctx.bias_dtype is not None
        bias_sums = torch.empty_like(weight_sums) if has_bias else weight_sums  # every block writes its row
        residual = dx if dresidual is None else dresidual.contiguous()
        _norm_backward_kernel[(blocks,)](x, weight, dout, residual, rstd, mean, dx, weight_sums, bias_sums, rows,
                                         hidden, BLOCK=triton.next_power_of_2(hidden), ROWS=ROWS, RMS=ctx.rms,
                                         HAS_BIAS=has_bias, HAS_RESIDUAL=dresidual is not None)
        bias_grad = bias_sums.sum(0).to(ctx.bias_dtype) if has_bias else None
        return dx, weight_sums.sum(0).to(weight.dtype), bias_grad, None, None, None


def small_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, rms: bool,
               pass_residual: bool = False):
    """LayerNorm (rms False; bias may be None) or RMSNorm of x over its last dim on the kernels (calls that
    `takes`), any leading shape; with pass_residual (output, x), x's two gradients summed in the backward."""
    flat = x.view(-1, x.shape[-1])
    if not pass_residual:
        return _SmallNorm.apply(flat, weight, bias, eps, rms, False).view(x.shape)
    out, residual = _SmallNorm.apply(flat, weight, bias, eps, rms, True)
    return out.view(x.shape), residual.view(x.shape)


def takes(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the kernels take this call: a contiguous x on a GPU with Triton, its last dim up to
    MAX_HIDDEN, the weight (and bias) one contiguous value per column in one dtype."""
    hidden = x.shape[-1]
    return (HAVE_TRITON and x.is_cuda and x.is_contiguous() and x.numel() > 0 and hidden <= MAX_HIDDEN
            and all(p.shape == (hidden,) and p.is_contiguous() and p.dtype == weight.dtype
                    for p in (weight, bias) if p is not None))
