"""The backward of our elementwise Triton kernels whose inputs include per-column vectors (a bias, a layer
scale: models/residual_add.py, models/bias_gelu.py): each program takes one tile of ROWS x COLUMNS of the
[rows, width] gradient, writes its part of x's gradient and its block of rows' fp32 sums per column,
which torch then adds over the blocks. Deterministic (no atomics), one pass over the gradient."""

import torch

from megatron_hetero.models.accelerators import has_triton

ROWS, COLUMNS = 32, 128  # a program's tile

if has_triton():
    import triton
    import triton.language as tl

    @triton.jit
    def tile(rows, width, ROWS: tl.constexpr, COLUMNS: tl.constexpr):
        """This program's tile of a row-major [rows, width] tensor: the elements' offsets and mask, its
        columns and which lie inside the width, and where its block of rows' sums go in a [blocks, width]
        tensor."""
        row_block = tl.program_id(0).to(tl.int64)
        row = row_block * ROWS + tl.arange(0, ROWS)
        column = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        in_width = column < width
        mask = (row < rows)[:, None] & in_width[None, :]
        return row[:, None] * width + column[None, :], mask, column, in_width, row_block * width + column


def per_column(t: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Whether `t` is one contiguous value per column of `x` in x's dtype (or None: no such input)."""
    return t is None or (t.shape == x.shape[-1:] and t.dtype == x.dtype and t.is_contiguous())


def backward(kernel, grad: torch.Tensor, inputs: tuple, sums: int, **constexprs):
    """Runs `kernel(grad, *inputs, dx, *sums' tensors, rows, width, **constexprs, ROWS, COLUMNS)` over the
    tiles of `grad` (its last dimension the width); returns dx (grad's shape and dtype) and the `sums`
    per-column fp32 sums over all rows."""
    grad = grad.contiguous()
    width = grad.shape[-1]
    rows = grad.numel() // width
    dx = torch.empty_like(grad)
    blocks = triton.cdiv(rows, ROWS)
    partial = [torch.empty(blocks, width, device=grad.device, dtype=torch.float32) for _ in range(sums)]
    kernel[(blocks, triton.cdiv(width, COLUMNS))](grad, *inputs, dx, *partial, rows, width, **constexprs,
                                                  ROWS=ROWS, COLUMNS=COLUMNS)
    return dx, [block_sums.sum(0) for block_sums in partial]
