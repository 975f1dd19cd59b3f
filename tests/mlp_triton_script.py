"""`python -m tests.mlp_triton_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_mlp_kernels.py runs it so): models/mlp_kernels.py's Triton halves copy on
Triton's CPU interpreter against torch's strided copy, bit for bit. Prints, last, one JSON object:
"<shape> <dtype>" -> equal."""

import json

import torch

from megatron_hetero.models.mlp_kernels import PAIRS_BLOCK, halves_by_words, pairs_as_words, strided_halves

# [.., 2 n] with n a block and a bit (the last block masked), one pair, a 3-D tensor
SHAPES = ((3, 2 * (PAIRS_BLOCK + 5)), (2, 2), (2, 3, 14))


def main():
    gen = torch.Generator().manual_seed(0)
    equal = {}
    for shape in SHAPES:
        for dtype in (torch.bfloat16, torch.float16):
            x = torch.randn(shape, generator=gen).to(dtype)
            assert pairs_as_words(x)
            want = strided_halves(x)
            equal[f"{shape} {dtype}"] = torch.equal(halves_by_words(x).view(torch.int16), want.view(torch.int16))
    print(json.dumps(equal))


if __name__ == "__main__":
    main()
