"""The packed ViTs' attention input and output (models/packed_attention.py: packed_heads, cut_heads) as
Triton kernels called at an eager op's host cost: the QKV bias, the split into query, key and value heads,
RoPE on the query and the key and the zero padding to the attention kernel's head dim in one kernel each
way; the padded columns' cut in one copy kernel each way.

Why: compiled (torch.compile) each is one pass each way, but a compiled function's call costs the host
about 0.2 ms forward and 0.3 ms backward in its wrappers (one H100: docs/results.md, "Where the step waits
on the host"), 32 layers x 4 microbatches a step in Qwen2.5-VL-7B, and where the host falls behind the
GPU waits for it (the windows' attention launched after the attention input: 41.5 ms of idle a step
there). Here each program takes a block of tokens and one head of the QKV output ([tokens, 1, groups x
(per_group + 2) x head_dim], megatron-core's layout: each query group's query heads, then its key and its
value head): y = x + bias, and for a query or key head [y1 c1 - y2 s1, y2 c2 + y1 s2] (rope.rotate's
arithmetic) in fp32, rounded once, and zeros to the run dim. The backward needs only the tables: x's
gradient is [g1 c1 + g2 s2, g2 c2 - g1 s1] of the heads' gradients (their padded columns dropped), and
each block of tokens' fp32 sums of it give the bias's gradient, which torch adds up.

`MEGATRON_HETERO_ATTENTION_INPUT` (kernel_policy.ATTENTION_INPUT_ENV, the layer's policy): auto (the
default) and torch: the compiled functions; triton: these kernels on a GPU with Triton where the call
`takes` (one token a row, an even head dim, contiguous tensors of one dtype, tables without gradients),
the compiled functions elsewhere. On an H100 they cost the host less a call (0.62 against 0.96 ms forward
and backward at Qwen2.5-VL-7B's shape) but made its step no faster there, where the GPU seldom waited
for the attention input (docs/results.md, "The packed ViTs' attention input on one Triton kernel"): a
choice for a host that falls behind. Its peak there was 1.6 GiB lower: unpadded, the compiled function's
value heads are views of its whole x + bias output, which the attention's saved value keeps alive.
"""

import torch

from megatron_hetero.models import column_sums
from megatron_hetero.models.accelerators import has_triton

HAVE_TRITON = has_triton()
SUMMARY = "attention input: triton"  # attention_summary's words where these kernels run (start-up line, records)
ROWS = 16  # tokens a program
MAX_HEAD_DIM = 256

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _head(slot, per_group, q, k, v, cos_q, sin_q, cos_k, sin_k):
        """Where a slot of the QKV layout goes: its heads' tensor, the head's index there, that tensor's
        heads, its RoPE tables, whether it rotates."""
        slots = tl.num_programs(1)
        groups = slots // (per_group + 2)
        group, j = slot // (per_group + 2), slot % (per_group + 2)
        out, head, heads, cos, sin = v, group, groups, cos_k, sin_k
        if j < per_group:
            out, head, heads, cos, sin = q, group * per_group + j, groups * per_group, cos_q, sin_q
        elif j == per_group:
            out = k
        return out, head, heads, cos, sin, j <= per_group

    @triton.jit
    def _tables(cos, sin, row, column, mask, HEAD_DIM: tl.constexpr):
        """The rows' RoPE tables ([tokens, head_dim] each) by halves, in fp32: cos's and then sin's."""
        table = row[:, None] * HEAD_DIM + column[None, :]
        return (tl.load(cos + table, mask=mask, other=0.0).to(tl.float32),
                tl.load(cos + table + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32),
                tl.load(sin + table, mask=mask, other=0.0).to(tl.float32),
                tl.load(sin + table + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32))

    @triton.jit
    def _heads_kernel(mixed, bias, cos_q, sin_q, cos_k, sin_k, q, k, v, rows, per_group, HEAD_DIM: tl.constexpr,
                      RUN_DIM: tl.constexpr, HALF: tl.constexpr, PAD: tl.constexpr, ROWS: tl.constexpr,
                      HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr):
        """One block of ROWS tokens of one slot: (x + bias), rotated if a query or key head, zero-padded to
        RUN_DIM, in fp32 rounded once. HALF, PAD: powers of two >= HEAD_DIM / 2 and RUN_DIM - HEAD_DIM."""
        slot = tl.program_id(1)
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, HALF)
        mask = (row < rows)[:, None] & (column < HEAD_DIM // 2)[None, :]
        first = row[:, None] * (tl.num_programs(1) * HEAD_DIM) + slot * HEAD_DIM + column[None, :]
        x1 = tl.load(mixed + first, mask=mask).to(tl.float32)
        x2 = tl.load(mixed + first + HEAD_DIM // 2, mask=mask).to(tl.float32)
        if HAS_BIAS:
            at = bias + slot * HEAD_DIM + column
            x1 += tl.load(at, mask=column < HEAD_DIM // 2).to(tl.float32)[None, :]
            x2 += tl.load(at + HEAD_DIM // 2, mask=column < HEAD_DIM // 2).to(tl.float32)[None, :]
        out, head, heads, cos, sin, rotates = _head(slot, per_group, q, k, v, cos_q, sin_q, cos_k, sin_k)
        y1, y2 = x1, x2
        if HAS_ROPE:
            if rotates:
                c1, c2, s1, s2 = _tables(cos, sin, row, column, mask, HEAD_DIM)
                y1, y2 = x1 * c1 - x2 * s1, x2 * c2 + x1 * s2
        to = out + row[:, None] * (heads * RUN_DIM) + head * RUN_DIM + column[None, :]
        tl.store(to, y1.to(out.dtype.element_ty), mask=mask)
        tl.store(to + HEAD_DIM // 2, y2.to(out.dtype.element_ty), mask=mask)
        if RUN_DIM > HEAD_DIM:
            pad = tl.arange(0, PAD)
            pad_mask = (row < rows)[:, None] & (pad < RUN_DIM - HEAD_DIM)[None, :]
            zeros = tl.zeros((ROWS, PAD), dtype=out.dtype.element_ty)
            tl.store(out + row[:, None] * (heads * RUN_DIM) + head * RUN_DIM + HEAD_DIM + pad[None, :], zeros,
                     mask=pad_mask)

    @triton.jit
    def _heads_backward_kernel(dq, dk, dv, cos_q, sin_q, cos_k, sin_k, dmixed, bias_sums, rows, per_group,
                               HEAD_DIM: tl.constexpr, RUN_DIM: tl.constexpr, HALF: tl.constexpr,
                               ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_ROPE: tl.constexpr):
        """One block of ROWS tokens of one slot: x's gradient from its head's (un-rotated if a query or key
        head, the padded columns dropped), rounded once; its fp32 sums over the block for the bias."""
        slot = tl.program_id(1)
        row_block = tl.program_id(0).to(tl.int64)
        row = row_block * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, HALF)
        in_half = column < HEAD_DIM // 2
        mask = (row < rows)[:, None] & in_half[None, :]
        grad, head, heads, cos, sin, rotates = _head(slot, per_group, dq, dk, dv, cos_q, sin_q, cos_k, sin_k)
        at = grad + row[:, None] * (heads * RUN_DIM) + head * RUN_DIM + column[None, :]
        g1 = tl.load(at, mask=mask, other=0.0).to(tl.float32)
        g2 = tl.load(at + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
        d1, d2 = g1, g2
        if HAS_ROPE:
            if rotates:
                c1, c2, s1, s2 = _tables(cos, sin, row, column, mask, HEAD_DIM)
                d1, d2 = g1 * c1 + g2 * s2, g2 * c2 - g1 * s1
        width = tl.num_programs(1) * HEAD_DIM
        first = row[:, None] * width + slot * HEAD_DIM + column[None, :]
        tl.store(dmixed + first, d1.to(dmixed.dtype.element_ty), mask=mask)
        tl.store(dmixed + first + HEAD_DIM // 2, d2.to(dmixed.dtype.element_ty), mask=mask)
        if HAS_BIAS:
            sums = bias_sums + row_block * width + slot * HEAD_DIM + column
            tl.store(sums, tl.sum(d1, axis=0), mask=in_half)
            tl.store(sums + HEAD_DIM // 2, tl.sum(d2, axis=0), mask=in_half)

    @triton.jit
    def _copy_heads_kernel(src, dst, rows, heads, SRC_DIM: tl.constexpr, DST_DIM: tl.constexpr,
                           BLOCK: tl.constexpr, ROWS: tl.constexpr):
        """[rows, heads, SRC_DIM] -> [rows, heads, DST_DIM]: each head's first min(SRC_DIM, DST_DIM)
        columns, zeros after them. BLOCK: a power of two >= DST_DIM."""
        head = tl.program_id(1)
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        column = tl.arange(0, BLOCK)
        in_rows = (row < rows)[:, None]
        values = tl.load(src + row[:, None] * (heads * SRC_DIM) + head * SRC_DIM + column[None, :],
                         mask=in_rows & (column < SRC_DIM)[None, :], other=0.0)
        tl.store(dst + row[:, None] * (heads * DST_DIM) + head * DST_DIM + column[None, :], values,
                 mask=in_rows & (column < DST_DIM)[None, :])


def _dims(head_dim: int, run_dim: int) -> dict:
    return dict(HEAD_DIM=head_dim, RUN_DIM=run_dim, HALF=triton.next_power_of_2(head_dim // 2))


class _PackedHeads(torch.autograd.Function):
    """forward: the QKV output plus its bias -> query, key and value heads, rotated and padded (one
    kernel); backward: the QKV output's gradient and the bias's sums (one kernel and torch's sum over the
    blocks of tokens)."""

    @staticmethod
    def forward(ctx, mixed, bias, tables, per_group, head_dim, run_dim):
        tokens, slots = mixed.shape[0], mixed.shape[-1] // head_dim
        groups = slots // (per_group + 2)
        q = mixed.new_empty(tokens, groups * per_group, run_dim)
        k, v = (mixed.new_empty(tokens, groups, run_dim) for _ in range(2))
        rope = tables if tables is not None else (mixed,) * 4
        _heads_kernel[(triton.cdiv(tokens, ROWS), slots)](
            mixed, mixed if bias is None else bias, *rope, q, k, v, tokens, per_group, **_dims(head_dim, run_dim),
            PAD=triton.next_power_of_2(max(run_dim - head_dim, 1)), ROWS=ROWS, HAS_BIAS=bias is not None,
            HAS_ROPE=tables is not None)
        ctx.save_for_backward(*(tables or ()))
        ctx.shape, ctx.has_bias, ctx.dims = mixed.shape, bias is not None, (per_group, head_dim, run_dim)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        per_group, head_dim, run_dim = ctx.dims
        tokens, width = ctx.shape[0], ctx.shape[-1]
        dmixed = dq.new_empty(ctx.shape)
        blocks = triton.cdiv(tokens, ROWS)
        sums = dq.new_empty(blocks, width, dtype=torch.float32) if ctx.has_bias else dmixed
        rope = ctx.saved_tensors or (dmixed,) * 4
        _heads_backward_kernel[(blocks, width // head_dim)](
            dq.contiguous(), dk.contiguous(), dv.contiguous(), *rope, dmixed, sums, tokens, per_group,
            **_dims(head_dim, run_dim), ROWS=ROWS, HAS_BIAS=ctx.has_bias, HAS_ROPE=bool(ctx.saved_tensors))
        bias_grad = sums.sum(0).to(dq.dtype) if ctx.has_bias and ctx.needs_input_grad[1] else None
        return dmixed, bias_grad, None, None, None, None


def _copy_heads(src: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
    """src [tokens, ..., heads * src_dim] -> [tokens, ..., heads * dim]: each head cut or zero-padded."""
    src = src.contiguous()
    tokens, src_dim = src.numel() // src.shape[-1], src.shape[-1] // heads
    dst = src.new_empty(*src.shape[:-1], heads * dim)
    _copy_heads_kernel[(triton.cdiv(tokens, ROWS), heads)](src, dst, tokens, heads, SRC_DIM=src_dim, DST_DIM=dim,
                                                           BLOCK=triton.next_power_of_2(dim), ROWS=ROWS)
    return dst


class _CutHeads(torch.autograd.Function):
    """forward: each head's first head_dim columns (one copy kernel); backward: the gradient zero-padded back
    to the run dim (the same kernel)."""

    @staticmethod
    def forward(ctx, out, heads, head_dim):
        ctx.heads, ctx.run_dim = heads, out.shape[-1] // heads
        return _copy_heads(out, heads, head_dim)

    @staticmethod
    def backward(ctx, grad):
        return _copy_heads(grad, ctx.heads, ctx.run_dim), None, None


def packed_heads(mixed: torch.Tensor, bias: torch.Tensor | None, rotary: tuple | None, groups: int,
                 per_group: int, head_dim: int, run_dim: int) -> tuple[torch.Tensor, ...]:
    """packed_attention.packed_heads on the kernels (calls that `takes`): query [tokens, groups * per_group,
    run_dim], key and value [tokens, groups, run_dim]."""
    tables = None if rotary is None else tuple(t.reshape(t.shape[0], head_dim) for t in rotary)
    return _PackedHeads.apply(mixed, bias, tables, per_group, head_dim, run_dim)


def cut_heads(out: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """packed_attention.cut_heads on the kernel: [tokens, 1, heads * run_dim] -> [tokens, 1, heads * head_dim]."""
    return _CutHeads.apply(out, heads, head_dim)


def cuts(out: torch.Tensor) -> bool:
    """Whether the cut kernel takes this attention output: on a GPU with Triton."""
    return HAVE_TRITON and out.is_cuda


def takes(mixed: torch.Tensor, bias: torch.Tensor | None, rotary: tuple | None, head_dim: int) -> bool:
    """Whether the kernels take this call: a contiguous [tokens, 1, width] QKV output on a GPU, an even head
    dim up to MAX_HEAD_DIM, the bias one contiguous value per column in its dtype, the tables [tokens, 1,
    1, head_dim], contiguous, in its dtype, without gradients."""
    if not (HAVE_TRITON and mixed.is_cuda and mixed.dim() == 3 and mixed.shape[1] == 1 and mixed.is_contiguous()
            and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM):
        return False
    return column_sums.per_column(bias, mixed) and (rotary is None or all(
        t.shape == (mixed.shape[0], 1, 1, head_dim) and t.dtype == mixed.dtype and t.is_contiguous()
        and not t.requires_grad for t in rotary))
