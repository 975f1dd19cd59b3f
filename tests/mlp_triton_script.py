"""`python -m tests.mlp_triton_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_mlp_kernels.py runs it so): models/mlp_kernels.py's Triton kernels on Triton's
CPU interpreter. Prints, last, one JSON object: "halves <shape> <dtype>" -> whether the Triton halves copy
equals torch's strided copy bit for bit; "swiglu <shape> <dtype>" -> the Triton SwiGLU backward's max
|diff| / max |ref| against megatron-core's swiglu_back in fp32 (the interpreter loads bf16 wrongly: fp32
and fp16 there; bf16 is `megatron-hetero kernels check mlp`'s, on a GPU)."""

import json

import torch
from megatron.core.fusions.fused_bias_swiglu import swiglu_back

from megatron_hetero.models.mlp_kernels import PAIRS_BLOCK, halves_by_words, pairs_as_words, swiglu_backward_by_pairs

# [.., 2 n] with n a block and a bit (the last block masked), one pair, a 3-D tensor
SHAPES = ((3, 2 * (PAIRS_BLOCK + 5)), (2, 2), (2, 3, 14))


def main():
    gen = torch.Generator().manual_seed(0)
    results = {}
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(shape, generator=gen).to(dtype)
            assert pairs_as_words(x)
            want = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
            got = halves_by_words(x)
            results[f"halves {shape} {dtype}"] = torch.equal(got.view(torch.int16), want.view(torch.int16))
        for dtype in (torch.float32, torch.float16):
            preact = (3 * torch.randn(shape, generator=gen)).to(dtype)
            grad = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype)
            want = swiglu_back(grad.double(), preact.double())
            got = swiglu_backward_by_pairs(grad, preact).double()
            results[f"swiglu {shape} {dtype}"] = float((got - want).abs().max() / want.abs().max())
    print(json.dumps(results))


if __name__ == "__main__":
    main()
