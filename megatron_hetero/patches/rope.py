"""Rotary embeddings in one fused kernel on GPUs (megatron-core 0.19 `rope_utils._apply_rotary_pos_emb_bshd`,
the path every RoPE model takes without Transformer Engine's fused RoPE).

Upstream computes `t * cos + rotate_half(t) * sin` as separate kernels: cos and sin of the
frequencies, two multiplies and an add, a `torch.cat` in rotate-half and another re-attaching the
(usually empty) part of the head that does not rotate. In a W1 step on one H200 these copies and
elementwise kernels are several percent of the time (docs/runs/benchmarks.md). Where the whole head
rotates (not interleaved, no MLA layout) this patch computes the same halves directly, compiled
into fused kernels (torch.compile) on GPUs: the same numbers up to bf16 rounding (the fused kernel
rounds once). On CPUs upstream's formula runs, bit for bit, without its copy of the whole head into a
`torch.cat` with the empty part that does not rotate. With MEGATRON_HETERO_EAGER_ROPE=1 (to compare; the
kernel policy's eager_rope) upstream's own function runs.

Every layer, and the queries and keys of each, rotate by the same frequencies tensor (megatron-core's
blocks pass one table to all their layers; a packed ViT its table per forward): its cos and sin are
computed once, kept on the tensor itself while it lives (until its values change), not once per
call: 4 to 6 elementwise kernels fewer per query and per key of every layer.
"""

import torch

from megatron_hetero.models.kernel_policy import current
from megatron_hetero.patches._patch import replace


def cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """upstream's cos and sin of the frequencies [s, 1, 1, d], scaled, in the activations' dtype.
    Computed apart from the rotation: compiled together, the fused kernel recomputes both for
    every element of t (batch x heads times over), which made it run at a seventh of HBM speed."""
    return tuple((f(freqs) * mscale).to(dtype) for f in (torch.cos, torch.sin))


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """upstream's t * cos + rotate_half(t) * sin, half by half: [x1 c1 - x2 s1, x2 c2 + x1 s2]."""
    x1, x2 = t.chunk(2, dim=-1)
    (c1, c2), (s1, s2) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)


def cached_cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin(freqs, mscale, dtype), computed once per frequencies tensor (module docstring): kept
    on the tensor, by mscale, dtype and the tensor's version (an in-place change computes them anew)."""
    if (freqs.requires_grad or freqs.is_inference()  # a learnt table's stay in its graph; no version here
            or (freqs.is_cuda and torch.cuda.is_current_stream_capturing())):  # a CUDA graph replays its own
        return cos_sin(freqs, mscale, dtype)
    key = (mscale, dtype, freqs._version)
    cached = getattr(freqs, "_hetero_cos_sin", None)
    if cached is None or cached[0] != key:
        cached = (key, cos_sin(freqs, mscale, dtype))
        freqs._hetero_cos_sin = cached
    return cached[1]


_fused = None


def _rope(original):
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    def _apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=False, mla_rotary_interleaved=False, mscale=1.0,
                                   multi_latent_attention=None):
        global _fused
        whole_head = freqs.shape[-1] == t.shape[-1]
        if (rotary_interleaved or mla_rotary_interleaved or multi_latent_attention is not None
                or not whole_head or current().eager_rope):
            return original(t, freqs, rotary_interleaved, mla_rotary_interleaved, mscale, multi_latent_attention)
        cos, sin = cached_cos_sin(freqs, mscale, t.dtype)
        if not t.is_cuda:  # upstream's arithmetic, in its order
            return t * cos + _rotate_half(t, False) * sin
        if _fused is None:
            _fused = torch.compile(rotate)
        return _fused(t, cos, sin)
    return _apply_rotary_pos_emb_bshd


def apply() -> None:
    replace("megatron.core.models.common.embeddings.rope_utils._apply_rotary_pos_emb_bshd", _rope,
            params=("t", "freqs", "rotary_interleaved", "mla_rotary_interleaved", "mscale", "multi_latent_attention"))
