"""Attention within short packed segments (Qwen2.5-VL's windows: at most 64 patches each) in one Triton
program per segment and head, forward and backward.

A segment this short fits one tile: its queries, keys and values are loaded once, the scores and
probabilities stay in registers, and the backward writes dq, dk and dv of the segment directly. A
general flash-attention kernel is built for long sequences instead: tiles of 128 keys (half empty
here), dq accumulated in fp32 across key blocks through a padded buffer and converted by another
kernel, a separate pass for the rows' dO.O. On one H200 torch's varlen flash-attention took 0.155 ms
forward and 0.878 ms forward+backward for the 419 windows x 16 heads x 80 of the Qwen2.5-VL-7B bench
(tools/gpu_vit_probe.py), where reading and writing each tensor once (q, k, v, out, dO, dq, dk, dv:
67 MB each) needs about a quarter of that.

Layouts are flash-attention's varlen ones: q [total_q, heads, d], k, v [total_k, kv heads, d] (any
strides, the head dim contiguous), cu_q / cu_k int32 segment starts with the total last; segment i's
queries attend to its keys (causal: bottom-right aligned, the j-th query sees keys up to
len_k - len_q + j). The scores and softmax in fp32, the probabilities and dS cast to the inputs'
dtype for their matmuls, as flash-attention does; lse [heads, total_q] fp32.
"""

import torch

from megatron_hetero.models.accelerators import has_triton

HAVE_TRITON = has_triton()
MIN_BLOCK = 16  # tl.dot's smallest tile side
MAX_SEGMENT = 128  # one tile of keys per program: longer segments belong to a flash-attention kernel
MAX_HEAD_DIM = 128
# Warps per program, forward and backward: at Qwen2.5-VL-7B's windows (419 of at most 64 tokens, 16 heads
# x 80) on one H200 the forward took 0.125 ms at 8 warps against 0.137 at 2, and forward + backward
# 0.59 ms at 8/4 against 0.64 at 2/4 and 0.71 at 8/8 (tools/gpu_vit_probe.py --windows-only); ptxas gives
# the backward 255 registers with 8 bytes spilled at 4 warps (at 8, 160 bytes).
WARPS = (8, 4)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _load(base, rows, start, count, row_stride, head_offset, d, head_dim):
        mask = (rows < count)[:, None] & (d < head_dim)[None, :]
        return tl.load(base + (start + rows)[:, None] * row_stride + head_offset + d[None, :], mask=mask, other=0.0)

    @triton.jit
    def _store(base, value, rows, start, count, row_stride, head_offset, d, head_dim):
        mask = (rows < count)[:, None] & (d < head_dim)[None, :]
        tl.store(base + (start + rows)[:, None] * row_stride + head_offset + d[None, :], value, mask=mask)

    @triton.jit
    def _segment(cu_q, cu_k):
        """This program's segment: its queries' and keys' starts (int64: offsets past 2**31) and counts."""
        seg = tl.program_id(0)
        q0, k0 = tl.load(cu_q + seg).to(tl.int64), tl.load(cu_k + seg).to(tl.int64)
        return q0, k0, tl.load(cu_q + seg + 1) - q0, tl.load(cu_k + seg + 1) - k0

    @triton.jit
    def _scores(q, k, rows, len_q, len_k, scale, CAUSAL: tl.constexpr):
        """q k^T * scale, fp32, -inf outside the segment (and above its causal diagonal); `rows` index
        the tile's queries and keys alike."""
        s = tl.dot(q, tl.trans(k)) * scale
        valid = (rows < len_k)[None, :] & (rows < len_q)[:, None]
        if CAUSAL:
            valid = valid & (rows[None, :] <= rows[:, None] + (len_k - len_q))
        return tl.where(valid, s, float("-inf"))

    @triton.jit
    def _forward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, cu_q, cu_k, sq_t, sq_h, sk_t, sk_h, sv_t, sv_h,
                        so_t, so_h, total_q, scale, head_dim,
                        BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr):
        h = tl.program_id(1)
        q0, k0, len_q, len_k = _segment(cu_q, cu_k)
        rows, d = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
        q = _load(q_ptr, rows, q0, len_q, sq_t, h * sq_h, d, head_dim)
        k = _load(k_ptr, rows, k0, len_k, sk_t, h * sk_h, d, head_dim)
        v = _load(v_ptr, rows, k0, len_k, sv_t, h * sv_h, d, head_dim)
        s = _scores(q, k, rows, len_q, len_k, scale, CAUSAL)
        row_max = tl.max(s, 1)
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)  # a row without keys: zeros out
        p = tl.exp(s - row_max[:, None])
        total = tl.sum(p, 1)
        some = total > 0
        total = tl.where(some, total, 1.0)
        out = tl.dot(p.to(v.dtype), v) / total[:, None]
        _store(o_ptr, out.to(o_ptr.dtype.element_ty), rows, q0, len_q, so_t, h * so_h, d, head_dim)
        lse = tl.where(some, row_max + tl.log(total), float("inf"))
        tl.store(lse_ptr + h * total_q + q0 + rows, lse, mask=rows < len_q)

    @triton.jit
    def _backward_kernel(q_ptr, k_ptr, v_ptr, o_ptr, do_ptr, lse_ptr, dq_ptr, dk_ptr, dv_ptr, cu_q, cu_k,
                         sq_t, sq_h, sk_t, sk_h, sv_t, sv_h, so_t, so_h, sdo_t, sdo_h, total_q, scale, head_dim,
                         BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr):
        h = tl.program_id(1)
        q0, k0, len_q, len_k = _segment(cu_q, cu_k)
        rows, d = tl.arange(0, BLOCK), tl.arange(0, BLOCK_D)
        do = _load(do_ptr, rows, q0, len_q, sdo_t, h * sdo_h, d, head_dim)
        o = _load(o_ptr, rows, q0, len_q, so_t, h * so_h, d, head_dim)
        delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
        q = _load(q_ptr, rows, q0, len_q, sq_t, h * sq_h, d, head_dim)
        k = _load(k_ptr, rows, k0, len_k, sk_t, h * sk_h, d, head_dim)
        v = _load(v_ptr, rows, k0, len_k, sv_t, h * sv_h, d, head_dim)
        lse = tl.load(lse_ptr + h * total_q + q0 + rows, mask=rows < len_q, other=float("inf"))
        p = tl.exp(_scores(q, k, rows, len_q, len_k, scale, CAUSAL) - lse[:, None])
        # dq, dk, dv: contiguous [total, heads, head_dim]; each stored once computed (fewer live registers)
        row_stride, head_offset = tl.num_programs(1) * head_dim, h * head_dim
        dv = tl.dot(tl.trans(p.to(do.dtype)), do)
        _store(dv_ptr, dv.to(dv_ptr.dtype.element_ty), rows, k0, len_k, row_stride, head_offset, d, head_dim)
        ds = (p * (tl.dot(do, tl.trans(v)) - delta[:, None])).to(q.dtype)
        dq = tl.dot(ds, k) * scale
        _store(dq_ptr, dq.to(dq_ptr.dtype.element_ty), rows, q0, len_q, row_stride, head_offset, d, head_dim)
        dk = tl.dot(tl.trans(ds), q) * scale
        _store(dk_ptr, dk.to(dk_ptr.dtype.element_ty), rows, k0, len_k, row_stride, head_offset, d, head_dim)


def _block(n: int, least: int = MIN_BLOCK) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


class _ShortSegments(torch.autograd.Function):
    """forward: out = softmax(q k^T * scale [causal]) v within each segment, one program per segment
    and head; backward: dq, dk, dv of each segment by one program per segment and head (k and v
    with q's heads)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, longest: int, scale: float, causal: bool, warps: tuple[int, int]):
        total_q, heads, head_dim = q.shape
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        lse = torch.empty(heads, total_q, device=q.device, dtype=torch.float32)
        block, block_d = _block(longest), _block(head_dim)
        _forward_kernel[(cu_q.numel() - 1, heads)](
            q, k, v, out, lse, cu_q, cu_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), out.stride(0), out.stride(1), total_q, scale, head_dim,
            BLOCK=block, BLOCK_D=block_d, CAUSAL=causal, num_warps=warps[0])
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.scale, ctx.causal, ctx.block, ctx.block_d, ctx.warps = scale, causal, block, block_d, warps[1]
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        total_q, heads, head_dim = q.shape
        dout = dout if dout.stride(-1) == 1 else dout.contiguous()
        dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
        dk, dv = (torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in (k, v))
        _backward_kernel[(cu_q.numel() - 1, heads)](
            q, k, v, out, dout, lse, dq, dk, dv, cu_q, cu_k, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), out.stride(0), out.stride(1), dout.stride(0), dout.stride(1), total_q,
            ctx.scale, head_dim, BLOCK=ctx.block, BLOCK_D=ctx.block_d, CAUSAL=ctx.causal, num_warps=ctx.warps)
        return dq, dk, dv, None, None, None, None, None, None


def short_attention(q, k, v, cu_q, cu_k, longest: int, scale: float, causal: bool = False,
                    warps: tuple[int, int] = WARPS) -> torch.Tensor:
    """Attention within packed segments of at most `longest` (<= MAX_SEGMENT) tokens, differentiable;
    head dims up to MAX_HEAD_DIM; `warps` per program forward and backward (tools/gpu_vit_probe.py
    times others). Grouped key and value heads are repeated to q's first."""
    assert longest <= MAX_SEGMENT and q.shape[-1] <= MAX_HEAD_DIM, (longest, q.shape)
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _ShortSegments.apply(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), longest, scale, causal, warps)
