"""`python -m tests.bias_gelu_script` from the repository, with TRITON_INTERPRET=1 set before anything imports
Triton (tests/test_bias_gelu.py runs it so): models/bias_gelu.py's kernels on Triton's CPU interpreter
against torch's erf GELU in fp64: the output and x's gradient within one rounding of their dtype, the
bias's gradient (fp32 sums over the tokens) within that and fp32's reordering. Prints, last, one JSON
object: "<shape> <dtype>" -> [output, x's gradient, the bias's gradient within rounding]."""

import json

import torch
import torch.nn.functional as F

from megatron_hetero.models.bias_gelu import BLOCK, bias_gelu
from megatron_hetero.models.column_sums import COLUMNS, ROWS
from tests.interpreter import close

# [s, b, h]: a masked last block, one element a row; rows and columns past one backward tile, and one
SHAPES = ((3, 2, BLOCK // 2 + 7), (5, 1, 1), (ROWS + 3, 2, COLUMNS + 5), (ROWS, 1, COLUMNS))



def main():
    gen = torch.Generator().manual_seed(0)
    results = {}
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x, grad = (torch.randn(shape, generator=gen).mul(2).to(dtype) for _ in range(2))
            bias = torch.randn(shape[-1:], generator=gen).to(dtype)
            leaves = [t.clone().requires_grad_() for t in (x, bias)]
            out = bias_gelu(*leaves)
            out.backward(grad)
            reference = [x.double().requires_grad_(), bias.double().requires_grad_()]
            want = F.gelu(reference[0] + reference[1])
            want.backward(grad.double())
            results[f"{shape} {dtype}"] = [close(out, want), close(leaves[0].grad, reference[0].grad),
                                           close(leaves[1].grad, reference[1].grad)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
