"""`python -m tests.attention_input_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_attention_input.py runs it so): models/attention_input.py's kernels on Triton's CPU
interpreter against packed_attention's functions in fp64: the query, key and value heads and the QKV
output's gradient within one rounding of their dtype, the bias's gradient (fp32 sums over the tokens)
within that and fp32's reordering; the cut and its gradient equal to the functions' bit for bit. Prints,
last, one JSON object: "<shape> <dtype> <bias> <rope>" -> [heads, x's gradient, the bias's, the cut's
output and gradient]."""

import json

import torch

from megatron_hetero.models import attention_input, packed_attention
from tests.interpreter import close

# (tokens, groups, per_group, head_dim, run_dim): Qwen2.5-VL's padding with a masked last block of tokens;
# grouped queries, no padding, a whole block; three query heads a group; a masked half and a padding
# shorter than its block
SHAPES = ((attention_input.ROWS * 2 + 5, 2, 1, 80, 96), (attention_input.ROWS, 2, 2, 8, 8), (5, 1, 3, 72, 72),
          (20, 1, 1, 6, 16))



def main():
    gen = torch.Generator().manual_seed(0)
    results = {}
    for tokens, groups, per_group, head_dim, run_dim in SHAPES:
        width = groups * (per_group + 2) * head_dim
        for dtype in (torch.bfloat16, torch.float32):
            for has_bias in (True, False):
                for has_rope in (True, False):
                    mixed = torch.randn(tokens, 1, width, generator=gen).to(dtype)
                    bias = torch.randn(width, generator=gen).to(dtype) if has_bias else None
                    angles = torch.rand(2, tokens, 1, 1, head_dim, generator=gen) * 6
                    rotary = (angles[0].cos(), angles[0].sin(), angles[1].cos(), angles[1].sin()) if has_rope else None
                    rotary = rotary and tuple(t.to(dtype) for t in rotary)
                    grads = [torch.randn(tokens, heads, run_dim, generator=gen).to(dtype)
                             for heads in (groups * per_group, groups, groups)]
                    shape = (groups, per_group, head_dim, run_dim)

                    leaves = [t.clone().requires_grad_() if t is not None else None for t in (mixed, bias)]
                    got = attention_input.packed_heads(leaves[0], leaves[1], rotary, *shape)
                    torch.autograd.backward(got, grads)
                    wide = [t.double().requires_grad_() if t is not None else None for t in (mixed, bias)]
                    want = packed_attention.packed_heads(wide[0], wide[1], rotary and tuple(t.double() for t in rotary),
                                                         *shape)
                    torch.autograd.backward(want, [g.double() for g in grads])

                    heads = groups * per_group
                    out = torch.randn(tokens, 1, heads * run_dim, generator=gen).to(dtype).requires_grad_()
                    cut = attention_input.cut_heads(out, heads, head_dim)
                    grad = torch.randn(cut.shape, generator=gen).to(dtype)
                    (cut_grad,) = torch.autograd.grad(cut, out, grad)
                    reference = out.detach().clone().requires_grad_()
                    want_cut = packed_attention.cut_heads(reference, heads, head_dim)
                    (want_grad,) = torch.autograd.grad(want_cut, reference, grad)

                    results[f"{shape} {tokens} {dtype} {has_bias} {has_rope}"] = [
                        all(close(g, w) for g, w in zip(got, want, strict=True)),
                        close(leaves[0].grad, wide[0].grad),
                        not has_bias or close(leaves[1].grad, wide[1].grad),
                        torch.equal(cut, want_cut) and torch.equal(cut_grad, want_grad)]
    print(json.dumps(results))


if __name__ == "__main__":
    main()
