"""Rotary embeddings in one fused kernel on GPUs (megatron-core 0.19: the `apply_rotary_pos_emb` that
`transformer.attention` calls, which without Transformer Engine's fused RoPE runs
`rope_utils._apply_rotary_pos_emb_bshd`).

Upstream computes `t * cos + rotate_half(t) * sin` as separate kernels: cos and sin of the
frequencies, two multiplies and an add, a `torch.cat` in rotate-half and another re-attaching the
(usually empty) part of the head that does not rotate. In a W1 step on one H200 these copies and
elementwise kernels are several percent of the time (docs/runs/benchmarks.md). Where the whole head
rotates (not interleaved, no MLA layout, no packed thd layout, no TE fusion asked) this patch computes
the same halves directly, compiled into fused kernels (torch.compile) on GPUs: the same numbers up to
bf16 rounding (the fused kernel rounds once). On CPUs upstream's formula runs, bit for bit, without its
copy of the whole head into a `torch.cat` with the empty part that does not rotate. Where the layer's
kernel policy says eager_rope (MEGATRON_HETERO_EAGER_ROPE=1, to compare), upstream's own function runs.

Every layer, and the queries and keys of each, rotate by the same frequencies tensor (megatron-core's
blocks pass one table to all their layers; a packed ViT its table per forward): its cos and sin are
computed once, kept on the tensor itself while it lives (until its values change), not once per
call: 4 to 6 elementwise kernels fewer per query and per key of every layer.
"""

import functools

import torch

from megatron_hetero.models import kernel_policy
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


def fuses(config, head_dim: int, rotated: int, cu_seqlens=None, mla_rotary_interleaved=False) -> bool:
    """Whether a call of a layer of `config` (a TransformerConfig) rotating `rotated` of `head_dim`
    dims takes the fused rotation: upstream's bshd path (no packed thd layout, no TE fusion), the whole
    head rotated, not interleaved, and the config's kernel policy not asking for upstream's."""
    interleaved = config.rotary_interleaved or mla_rotary_interleaved or (
        mla_rotary_interleaved is None and config.multi_latent_attention)
    return (cu_seqlens is None and not config.apply_rope_fusion and not interleaved and rotated == head_dim
            and not kernel_policy.of(config).eager_rope)


@functools.cache
def _compiled_rotate():
    return torch.compile(rotate)


def _rope(original):
    from megatron.core.models.common.embeddings.rope_utils import _rotate_half

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None,
                             mla_rotary_interleaved=False):
        if not fuses(config, t.shape[-1], freqs.shape[-1], cu_seqlens, mla_rotary_interleaved):
            return original(t, freqs, config, cu_seqlens, mscale, cp_group, mla_rotary_interleaved)
        cos, sin = cached_cos_sin(freqs, mscale, t.dtype)
        if not t.is_cuda:  # upstream's arithmetic, in its order
            return t * cos + _rotate_half(t, False) * sin
        return _compiled_rotate()(t, cos, sin)
    return apply_rotary_pos_emb


def apply() -> None:
    replace("megatron.core.transformer.attention.apply_rotary_pos_emb", _rope,
            params=("t", "freqs", "config", "cu_seqlens", "mscale", "cp_group", "mla_rotary_interleaved"))
