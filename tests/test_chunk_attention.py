"""A CP chunk's bottom-right causal attention as two kernel calls merged by log-sum-exp
(models/chunk_attention.py) equals one masked softmax: outputs and gradients against float64
attention with an explicit mask and against SDPA's bottom-right mask, which it replaces; the GPU
gate lets the cuDNN path run only where it was checked."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from megatron_hetero.models.attention import causal_attention
from megatron_hetero.models.attention_kernels import Device, choose_kernel
from megatron_hetero.models.chunk_attention import (
    CPU_KERNEL,
    cudnn_merge_checked,
    prefix_causal_attention,
)
from megatron_hetero.models.kernel_policy import CUDNN_MERGE_ENV, build


def reference(q, k, v, scale=None):
    """float64 softmax attention, query i seeing keys up to sk - sq + i."""
    q, k, v = (t.double() for t in (q, k, v))
    sq, sk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-1, -2) * (scale if scale is not None else q.shape[-1] ** -0.5)
    visible = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
    return scores.masked_fill(~visible, float("-inf")).softmax(-1) @ v


def run(fn, q, k, v, grad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    out.backward(grad.to(out.dtype))
    return [t.double() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("sq, sk", [(5, 12), (8, 16), (8, 9), (16, 64)])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_merged_chunk_equals_one_masked_softmax(sq, sk, scale):
    torch.manual_seed(sq * sk)
    q, k, v = torch.randn(2, 3, sq, 16), torch.randn(2, 3, sk, 16), torch.randn(2, 3, sk, 16)
    grad = torch.randn(2, 3, sq, 16)
    merged = run(lambda *t: prefix_causal_attention(*t, CPU_KERNEL, scale), q, k, v, grad)
    expected = run(lambda *t: reference(*t, scale), q, k, v, grad)
    masked = run(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=causal_lower_right(sq, sk), scale=scale),
                 q, k, v, grad)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), merged, expected, masked):
        assert (a - b).abs().max() < 1e-5, name
        assert (a - c).abs().max() < 1e-5, name


def test_bf16_chunks_as_close_as_sdpas_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 32, 64), torch.randn(1, 4, 96, 64), torch.randn(1, 4, 96, 64)
    grad = torch.randn(1, 4, 32, 64)
    expected = run(reference, q, k, v, grad)
    bf16 = [t.bfloat16() for t in (q, k, v)]
    merged = run(lambda *t: prefix_causal_attention(*t, CPU_KERNEL), *bf16, grad)
    masked = run(lambda *t: F.scaled_dot_product_attention(*t, attn_mask=causal_lower_right(32, 96)), *bf16, grad)
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), merged, expected, masked):
        error, sdpa_error = ((x - b).abs().max() / b.abs().max() for x in (a, c))
        assert error < max(2 * sdpa_error, 1e-2), name


def test_the_kernel_choice_merges_on_cpus_and_checked_gpus_without_dropout():
    """The module's kernel choice decides (printed and recorded with it); causal_attention follows it."""
    hopper = Device("NVIDIA H200", (9, 0))
    assert choose_kernel("auto", 8, Device("cpu")).merged_chunks
    assert not choose_kernel("auto", 8, Device("cpu"), dropout=0.1).merged_chunks
    assert choose_kernel("sdpa", 128, hopper, merge_checked=True).merged_chunks
    assert not choose_kernel("auto", 128, hopper, import_problem="absent", merge_checked=False).merged_chunks
    choice = choose_kernel("auto", 8, Device("cpu"))
    assert choice.describe(2) == "sdpa (head dim 8: no GPU), CP chunks as merged calls"
    assert choice.describe(1) == str(choice)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    for merged in (True, False):
        torch.testing.assert_close(causal_attention(q, k, v, merged), reference(q, k, v).float(), atol=1e-5, rtol=1e-5)


def test_the_cudnn_path_runs_only_where_checked():
    default, merge = build(environ={}), build(environ={CUDNN_MERGE_ENV: "1"})
    assert cudnn_merge_checked("NVIDIA H200", torch.bfloat16, 128, default)  # listed
    assert not cudnn_merge_checked("NVIDIA B200", torch.bfloat16, 128, default)
    assert cudnn_merge_checked("NVIDIA B200", torch.bfloat16, 128, merge)
    assert not cudnn_merge_checked("NVIDIA H200", torch.float32, 128, merge)
    assert not cudnn_merge_checked("NVIDIA H200", torch.bfloat16, 256, merge)
