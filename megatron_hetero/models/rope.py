"""Rotary embeddings as one pass over the rotated tensor: upstream's `t * cos + rotate_half(t) * sin`
computed half by half (`rotate`), from a cos and sin computed once per frequencies tensor
(`cached_cos_sin`). Eager, it is upstream's arithmetic bit for bit; compiled (torch.compile) on GPUs
one kernel. Callers: megatron-core's attention through patches/rope.py, and the packed encoders'
attention (packed_attention.py), which rotates inside its own fused kernel."""

import torch


def cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """upstream's cos and sin of the frequencies [s, 1, 1, d], scaled, in the activations' dtype.
    Computed apart from the rotation: compiled together, the fused kernel recomputes both for
    every element of t (batch x heads times over), which made it run at a seventh of HBM speed."""
    return tuple((f(freqs) * mscale).to(dtype) for f in (torch.cos, torch.sin))


def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """upstream's t * cos + rotate_half(t) * sin, half by half: [x1 c1 - x2 s1, x2 c2 + x1 s2], with
    `pad` zero columns after it (written by the same concatenation: compiled, one kernel, where a pad
    after it was another pass on GPUs)."""
    x1, x2 = t.chunk(2, dim=-1)
    (c1, c2), (s1, s2) = cos.chunk(2, dim=-1), sin.chunk(2, dim=-1)
    zeros = (t.new_zeros(*t.shape[:-1], pad),) if pad else ()
    return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, *zeros), dim=-1)


def cached_cos_sin(freqs: torch.Tensor, mscale: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_sin(freqs, mscale, dtype), computed once per frequencies tensor: every layer, and the
    queries and keys of each, rotate by the same table (megatron-core's blocks pass one table to all
    their layers; a packed ViT its table per forward), so it is kept on the tensor itself while it
    lives, by mscale, dtype and the tensor's version (an in-place change computes it anew): 4 to 6
    elementwise kernels fewer per query and per key of every layer."""
    if (freqs.requires_grad or freqs.is_inference()  # a learnt table's stay in its graph; no version here
            or (freqs.is_cuda and torch.cuda.is_current_stream_capturing())):  # a CUDA graph replays its own
        return cos_sin(freqs, mscale, dtype)
    key = (mscale, dtype, freqs._version)
    cached = getattr(freqs, "_hetero_cos_sin", None)
    if cached is None or cached[0] != key:
        cached = (key, cos_sin(freqs, mscale, dtype))
        freqs._hetero_cos_sin = cached
    return cached[1]
