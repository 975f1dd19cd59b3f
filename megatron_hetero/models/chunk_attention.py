"""A CP query chunk's causal attention as two square-or-unmasked kernel calls merged by log-sum-exp.

Under context parallelism (attention.py) a rank's later query chunk, at global positions
[start, end), attends to the keys [0, end) with a bottom-right causal mask. torch's SDPA runs that
mask only on its FlashAttention-2 or memory-efficient kernels; cuDNN's kernel, the fastest SDPA has
on Hopper, takes the square causal case only. At 64K that cost our CP2 LLM 1.5x DP2's forward per
token (docs/runs/benchmarks.md, W6). The chunk's attention is the merge of two calls cuDNN takes: the
keys before the chunk, all visible, and the chunk's own keys, causal. Merged by their log-sum-exps
(lse = logaddexp(lse1, lse2), out = sum of out_i * exp(lse_i - lse)); backward hands each call's
kernel the merged output and log-sum-exp, which turns each kernel's backward into its share of the
whole softmax's (the split of FlashAttention's backward over key blocks that ring attention uses),
and sums the queries' gradients.

Kernels: cuDNN's aten ops on CUDA; on CPUs the CPU flash kernel's, the same arithmetic, so that CI
runs this path. On a GPU it runs only where `kernels check cp-chunks` (cli/checks/) found its outputs and
gradients as close to fp32 attention as SDPA's own (CUDNN_MERGE_CHECKED), else attention.py keeps
SDPA's bottom-right mask; the module's kernel choice says which (attention_kernels.KernelChoice's
merged_chunks, printed at start-up and recorded by the benchmarks).
"""

from collections.abc import Callable
from typing import NamedTuple

import torch

from megatron_hetero.models.kernel_policy import CUDNN_MERGE_CHECKED, KernelPolicy

# CUDNN_MERGE_CHECKED (kernel_policy.py, from kernel_checks.json): GPU models on which
# `megatron-hetero kernels check cp-chunks` passed, from its output (2026-11-26, torch 2.11, cuDNN 9.19; 1.5-1.8x
# faster than SDPA's mask at 16K-64K): docs/runs/gpu2/w6_dp2_cap80/ and
# h100_chunk_check/cp_chunk_check.log. The policy's cudnn_merge (MEGATRON_HETERO_CUDNN_MERGE_CHECKED=1)
# counts as listed: a GPU whose check just passed, before its entry is added.
CUDNN_DTYPES = (torch.bfloat16, torch.float16)
CUDNN_MAX_HEAD_DIM = 128


class _Kernel(NamedTuple):
    """forward(q, k, v, causal, scale) -> (out, lse, state); backward(dout, q, k, v, out, lse,
    state, causal, scale) -> (dq, dk, dv). q, k, v [b, h, s, d]; lse in the kernel's own shape."""

    forward: Callable
    backward: Callable


def _cpu_forward(q, k, v, causal, scale):
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, ()


def _cpu_backward(dout, q, k, v, out, lse, state, causal, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, scale=scale)


def _cudnn_forward(q, k, v, causal, scale):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(dout, q, k, v, out, lse, state, causal, scale):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, causal, scale=scale)


CPU_KERNEL = _Kernel(_cpu_forward, _cpu_backward)
CUDNN_KERNEL = _Kernel(_cudnn_forward, _cudnn_backward)


def cudnn_merge_checked(device_name: str, dtype: torch.dtype, head_dim: int, policy: KernelPolicy) -> bool:
    """Whether the cuDNN path may run queries of this dtype and head dim on this GPU model under `policy`."""
    listed = device_name in CUDNN_MERGE_CHECKED or policy.cudnn_merge
    return listed and dtype in CUDNN_DTYPES and head_dim <= CUDNN_MAX_HEAD_DIM


def chunk_kernel(device_type: str) -> _Kernel:
    """The kernel pair that runs merged chunks on this device type (the decision whether to merge is
    the module's kernel choice: attention_kernels.choose_kernel, merged_chunks)."""
    return CPU_KERNEL if device_type == "cpu" else CUDNN_KERNEL


def _splits(k: torch.Tensor, v: torch.Tensor, start: int):
    """The two calls' keys and values and their masks: keys before the chunk unmasked, its own causal."""
    return (k[:, :, :start], v[:, :, :start], False), (k[:, :, start:], v[:, :, start:], True)


def _merge(parts, dtype: torch.dtype, layout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of two (out_i, lse_i) over disjoint keys: lse [b, h, sq] in fp32 or wider, out of
    `dtype` with `layout`'s strides (the kernel's output layout, which its backward expects)."""
    acc = torch.promote_types(dtype, torch.float32)
    (o1, l1), (o2, l2) = ((o.to(acc), lse.reshape(o.shape[:-1]).to(acc)) for o, lse in parts)
    lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)
    return torch.empty_like(layout, dtype=dtype).copy_(merged), lse


class PrefixCausalAttention(torch.autograd.Function):
    """forward: queries q [b, h, sq, d] at the last sq of the sk key positions of k, v [b, h, sk, d]
    (sk > sq), bottom-right causal: keys [0, sk - sq) unmasked in one kernel call, keys [sk - sq, sk)
    causal in another, merged by log-sum-exp.
    backward: each call's kernel backward given the merged output and log-sum-exp (in that kernel's
    lse shape and dtype: cuDNN keeps a trailing 1); dq summed, dk and dv each call's keys'."""

    @staticmethod
    def forward(ctx, q, k, v, kernel: _Kernel, scale: float | None):
        start = k.shape[2] - q.shape[2]
        calls = [kernel.forward(q, kp, vp, causal, scale) for kp, vp, causal in _splits(k, v, start)]
        out, lse = _merge([(o, call_lse) for o, call_lse, _ in calls], q.dtype, calls[1][0])
        ctx.kernel, ctx.scale, ctx.start = kernel, scale, start
        ctx.calls = [(call_lse.shape, call_lse.dtype, state) for _, call_lse, state in calls]
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dout = torch.empty_like(out).copy_(dout)
        (dq1, dk1, dv1), (dq2, dk2, dv2) = (
            ctx.kernel.backward(dout, q, kp, vp, out, lse.reshape(shape).to(dtype), state, causal, ctx.scale)
            for (kp, vp, causal), (shape, dtype, state) in zip(_splits(k, v, ctx.start), ctx.calls))
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None, None


def prefix_causal_attention(q, k, v, kernel: _Kernel, scale: float | None = None) -> torch.Tensor:
    """Bottom-right causal attention of q [b, h, sq, d] over k, v [b, h, sk, d], sk > sq, on `kernel`
    (chunk_kernel) as two calls merged by log-sum-exp: PrefixCausalAttention."""
    return PrefixCausalAttention.apply(q, k, v, kernel, scale)
