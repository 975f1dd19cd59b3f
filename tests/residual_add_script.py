"""`python -m tests.residual_add_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_residual_add.py runs it so): models/residual_add.py's kernels on Triton's CPU
interpreter. Forward: residual + (x + bias) [* scale] in fp32 rounded once (as the interpreter rounds),
bit for bit; backward: the output's gradient to the residual, and to x as it is (no scale) or times the
scale rounded once; the bias's and the scale's gradients against fp64 sums. Prints, last, one JSON
object: "<shape> <dtype> <bias> <scale>" -> [forward equal, x's and the residual's gradients equal,
the bias's and the scale's within rounding]."""

import json

import torch

from megatron_hetero.models.column_sums import COLUMNS, ROWS
from megatron_hetero.models.residual_add import BLOCK, residual_add
from tests.interpreter import close

# [s, b, h]: a masked last block, one element a row, a whole number of blocks; with a scale, rows and
# columns past one tile (masked) and exactly one
SHAPES = ((3, 2, BLOCK // 2 + 7), (5, 1, 1), (2, 2, BLOCK), (ROWS + 3, 2, COLUMNS + 5), (ROWS, 1, COLUMNS))


def rounded(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 value in `dtype` as the kernel's cast rounds it here: Triton's interpreter casts fp32 to
    bf16 toward zero (GPUs to nearest even, as torch's cast does); fp16 as torch does."""
    if dtype == torch.bfloat16:
        total = (total.view(torch.int32) & ~0xFFFF).view(torch.float32)
    return total.to(dtype)



def main():
    gen = torch.Generator().manual_seed(0)
    equal = {}
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for with_bias in (True, False):
                for with_scale in (False, True):
                    x, residual, grad = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
                    bias, scale = (torch.randn(shape[-1:], generator=gen).to(dtype) if wanted else None
                                   for wanted in (with_bias, with_scale))
                    leaves = [t.clone().requires_grad_() if t is not None else None for t in (x, bias, residual, scale)]
                    out = residual_add(*leaves)
                    added = x.float() + (bias.float() if with_bias else 0)
                    total = residual.float() + (added * scale.float() if with_scale else added)
                    forward = torch.equal(out, rounded(total, dtype))
                    out.backward(grad)
                    dx = rounded(grad.float() * scale.float(), dtype) if with_scale else grad
                    exact = [torch.equal(leaves[0].grad, dx), torch.equal(leaves[2].grad, grad)]
                    per_token = (grad.double() * scale.double() if with_scale else grad.double()).reshape(-1, shape[-1])
                    sums = [close(leaves[1].grad, per_token.sum(0))] if with_bias else []
                    if with_scale:
                        sums.append(close(leaves[3].grad, (grad.double() * (x.double() + (
                            bias.double() if with_bias else 0))).reshape(-1, shape[-1]).sum(0)))
                    equal[f"{shape} {dtype} {with_bias} {with_scale}"] = [forward, all(exact), all(sums)]
    print(json.dumps(equal))


if __name__ == "__main__":
    main()
