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

The rotation and the cached cos and sin are models/rope.py's.
"""

import functools

import torch

from megatron_hetero.models import kernel_policy
from megatron_hetero.models.rope import cached_cos_sin, rotate
from megatron_hetero.patches._patch import replace


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
