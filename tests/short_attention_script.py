"""`python -m tests.short_attention_script` from the repository, with TRITON_INTERPRET=1 set before anything
imports Triton (tests/test_attention_kernels.py runs it so):
models/short_attention.py's kernels on Triton's CPU interpreter against fp64 attention, and
varlen_attention's Triton path against its SDPA path. Prints, last, one JSON object: case -> the max
|diff| / max |ref| of the output, dq, dk, dv. The interpreter loads bf16 wrongly: fp32 and fp16 here
(bf16 is `megatron-hetero kernels check attention`'s, on a GPU)."""

import json
import sys

import torch

from megatron_hetero.models.attention_kernels import SDPA, TRITON_SHORT, KernelChoice
from megatron_hetero.models.short_attention import short_attention
from megatron_hetero.models.varlen import VarlenPlan, varlen_attention
from tests.test_attention_kernels import _cu, _reference

# (head dim, heads, kv heads, query lengths, key lengths): windows of 1-64 tokens at Qwen2.5-VL's head
# dim 80 (padded to a 128-wide tile inside); head dim 72 with grouped key heads, keys longer than the
# queries and a segment without keys.
CASES = ((80, 3, 3, [5, 64, 17, 1], [5, 64, 17, 1]), (72, 4, 2, [3, 7, 30], [9, 0, 30]))


def reference(q, k, v, cu_q, cu_k, scale, causal):
    """Attention within each segment by the tests' per-sequence reference (in q's dtype, at least fp32;
    a segment without keys gives zeros)."""
    return torch.cat([_reference(q[a:b], k[c:e], v[c:e], scale, causal)
                      for a, b, c, e in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])])


def _errors(got, want) -> list[float]:
    return [((a.double() - b.double()).abs().max() / b.double().abs().max()).item() for a, b in zip(got, want)]


def kernel_errors(dtype, causal, d, heads, kv_heads, lengths_q, lengths_k) -> list[float]:
    gen = torch.Generator().manual_seed(0)
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    q = torch.randn(sum(lengths_q), heads, d, generator=gen).to(dtype).requires_grad_()
    kv = torch.randn(sum(lengths_k), kv_heads, 2 * d, generator=gen).to(dtype)
    k, v = kv[..., :d].detach().requires_grad_(), kv[..., d:].detach().requires_grad_()  # strided views
    out = short_attention(q, k, v, cu_q, cu_k, max(lengths_q + lengths_k), d**-0.5, causal)
    g = torch.randn(out.shape, generator=gen).to(dtype)
    got = [out, *torch.autograd.grad(out, (q, k, v), g)]
    assert out.dtype == dtype and all(x.shape == t.shape for x, t in zip(got[1:], (q, k, v)))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, cu_q.tolist(), cu_k.tolist(), d**-0.5, causal)
    return _errors(got, [ref, *torch.autograd.grad(ref, leaves, g.double())])


def varlen_errors(causal) -> list[float]:
    """varlen_attention's Triton path against its SDPA path (fp32; segments of several shapes, one
    without queries)."""
    lengths_q, lengths_k = [3, 5, 3, 7, 0, 5, 3], [3, 6, 3, 7, 2, 5, 4]
    plan = VarlenPlan.of(_cu(lengths_q), _cu(lengths_k))
    gen = torch.Generator().manual_seed(1)
    shapes = ((sum(lengths_q), 4, 8), (sum(lengths_k), 2, 8), (sum(lengths_k), 2, 8))
    leaves = [torch.randn(s, generator=gen, dtype=torch.float64).float().requires_grad_() for s in shapes]
    results = []
    for kernel in (KernelChoice(TRITON_SHORT, 8, 8), KernelChoice(SDPA, 8, 8)):
        out = varlen_attention(*leaves, plan, kernel, 0.3, causal)
        results.append([out, *torch.autograd.grad(out, leaves, torch.ones_like(out))])
    return _errors(*results)


def main() -> None:
    errors = {}
    for dtype in (torch.float32, torch.float16):
        for causal in (False, True):
            for case in CASES:
                errors[f"{dtype} causal={causal} d={case[0]}"] = kernel_errors(dtype, causal, *case)
    for causal in (False, True):
        errors[f"varlen causal={causal}"] = varlen_errors(causal)
    json.dump(errors, sys.stdout)


if __name__ == "__main__":
    main()
