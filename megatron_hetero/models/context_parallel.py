"""Megatron's load-balanced context-parallel sequence layout (pure)."""

import torch


def cp_positions(seq_len: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Global positions held by CP rank `cp_rank`, in local order: the sequence is cut into 2*cp
    chunks and rank r holds chunks r and 2*cp-1-r (megatron-core's get_batch_on_this_cp_rank)."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp}")
    chunk = seq_len // (2 * cp)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp - 1 - cp_rank)]) \
        if cp > 1 else torch.arange(seq_len)
