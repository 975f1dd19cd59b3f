"""The QKV split and RoPE as one function whose backward writes the fused QKV gradient in one pass,
without Transformer Engine (megatron-core 0.19 `transformer.attention`: `HAVE_FUSED_QKV_ROPE`,
`apply_fused_qkv_rotary_pos_emb`).

Upstream splits linear_qkv's output into q, k, v views, rotates q and k, and in backward
concatenates dq, dk, dv back into one gradient (`torch.cat`, after RoPE's backward wrote dq and dk
once already): in W1's profiled step on one H200 the cat alone is 16 ms, the RoPE backward kernels
as much again. megatron-core has the hook for the fused version, `config.fused_single_qkv_rope`
(no split before RoPE, no cat of its gradients), but takes the function from Transformer Engine.
This patch provides it where TE is absent: on GPUs the split and rotation compiled together
(torch.compile), so that backward is one kernel reading dq, dk, dv and writing the QKV gradient
(inductor writes each part into its slice of the output); on CPUs the same functions eagerly, bit
for bit upstream's split and rotation. Only runs that set the config field take it: the LLM under
`--hetero-fused-qkv-rope` (models/vlm.py build_llm says where megatron-core's path applies).
"""

import torch

from megatron_hetero.patches import rope
from megatron_hetero.patches._patch import set_value

MODULE = "megatron.core.transformer.attention"


def split_rotate(mixed_qkv: torch.Tensor, cos_q: torch.Tensor, sin_q: torch.Tensor, cos_k: torch.Tensor,
                 sin_k: torch.Tensor, split: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """upstream's split of [s, b, groups, (q heads per group + 2) * head dim] into query [s, b, heads,
    head dim], key and value [s, b, groups, head dim], with query and key rotated (rope.rotate)."""
    query, key, value = torch.split(mixed_qkv, split, dim=3)
    query = query.reshape(query.size(0), query.size(1), -1, split[1])
    return rope.rotate(query, cos_q, sin_q), rope.rotate(key, cos_k, sin_k), value


_compiled = None


def apply_fused_qkv_rotary_pos_emb(mixed_qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                                   split: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TE's function of that name (sbhd, not interleaved): query, key, value from the unsplit QKV
    tensor and the frequencies [s, 1|b, 1, rotary dim]. A partial rotary dim takes upstream's path."""
    global _compiled
    head_dim = split[1]
    if q_freqs.shape[-1] != head_dim or k_freqs.shape[-1] != head_dim:
        query, key, value = torch.split(mixed_qkv, split, dim=3)
        query = query.reshape(query.size(0), query.size(1), -1, head_dim)
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        return _apply_rotary_pos_emb_bshd(query, q_freqs), _apply_rotary_pos_emb_bshd(key, k_freqs), value
    function = split_rotate
    if mixed_qkv.is_cuda:
        if _compiled is None:
            _compiled = torch.compile(split_rotate)
        function = _compiled
    cos_sin_q = rope.cos_sin(q_freqs, 1.0, mixed_qkv.dtype)
    cos_sin_k = cos_sin_q if k_freqs is q_freqs else rope.cos_sin(k_freqs, 1.0, mixed_qkv.dtype)
    return function(mixed_qkv, *cos_sin_q, *cos_sin_k, list(split))


def apply() -> None:
    from megatron.core.transformer import attention

    if attention.HAVE_FUSED_QKV_ROPE and vars(attention).get(
            "apply_fused_qkv_rotary_pos_emb") is not apply_fused_qkv_rotary_pos_emb:
        return  # Transformer Engine's
    set_value(f"{MODULE}.apply_fused_qkv_rotary_pos_emb", apply_fused_qkv_rotary_pos_emb, type(split_rotate),
              create=True)
    set_value(f"{MODULE}.HAVE_FUSED_QKV_ROPE", True, bool)
