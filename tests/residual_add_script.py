"""`python -m tests.residual_add_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_residual_add.py runs it so): models/residual_add.py's kernel on Triton's CPU
interpreter. Forward: residual + (x + bias) in fp32 rounded once (as the interpreter rounds), bit for
bit; backward: the output's gradient to x and residual, its sum over the tokens to the bias. Prints,
last, one JSON object: "<shape> <dtype> <bias>" -> [forward equal, gradients equal]."""

import json

import torch

from megatron_hetero.models.residual_add import BLOCK, residual_add

# [s, b, h] with a masked last block, one element a row, a whole number of blocks
SHAPES = ((3, 2, BLOCK // 2 + 7), (5, 1, 1), (2, 2, BLOCK))


def rounded(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 sum in `dtype` as the kernel's cast rounds it here: Triton's interpreter casts fp32 to
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
                x, residual, grad = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
                bias = torch.randn(shape[-1:], generator=gen).to(dtype) if with_bias else None
                inputs = [t.clone().requires_grad_() for t in (x, residual) + ((bias,) if with_bias else ())]
                out = residual_add(inputs[0], inputs[2] if with_bias else None, inputs[1])
                total = residual.float() + (x.float() + (bias.float() if with_bias else 0))
                forward = torch.equal(out, rounded(total, dtype))
                out.backward(grad)
                grads = [torch.equal(inputs[0].grad, grad), torch.equal(inputs[1].grad, grad)]
                if with_bias:
                    grads.append(torch.equal(inputs[2].grad, grad.reshape(-1, shape[-1]).sum(0)))
                equal[f"{shape} {dtype} {with_bias}"] = [forward, all(grads)]
    print(json.dumps(equal))


if __name__ == "__main__":
    main()
