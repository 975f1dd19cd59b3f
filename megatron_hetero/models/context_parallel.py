"""Megatron's load-balanced context-parallel sequence layout (pure torch, no process groups).

The sequence is cut into 2*cp equal chunks; CP rank r holds chunks r and 2*cp-1-r, concatenated in
that order (megatron-core `get_batch_on_this_cp_rank`). Causal attention then costs every rank the
same: an early chunk (few keys) is paired with a late one (many keys). An encoder's full attention
costs every query the same: its CP rank r holds the r-th of cp contiguous parts of an item's tokens
(`contiguous_part`), as the boundary expects its rows.
"""

import torch


def cp_chunk_len(seq_len: int, cp: int) -> int:
    """Length of one of the 2*cp chunks of a sequence of seq_len."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 * cp = {2 * cp}")
    return seq_len // (2 * cp)


def cp_positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """Global positions (LongTensor [seq_len // cp]) held by `cp_rank`, in its local order.
    Without CP (cp == 1) the whole sequence, of any length."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} is outside 0..{cp - 1} (cp size {cp})")
    if cp == 1:
        return torch.arange(seq_len, device=device)
    chunk = cp_chunk_len(seq_len, cp)
    ends = [(cp_rank, cp_rank + 1), (2 * cp - 1 - cp_rank, 2 * cp - cp_rank)]
    return torch.cat([torch.arange(a * chunk, b * chunk, device=device) for a, b in ends])


def cp_slice(tensor: torch.Tensor, seq_dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The part of a full-sequence `tensor` that `cp_rank` holds (the tensor itself when cp == 1)."""
    positions = cp_positions(tensor.shape[seq_dim], cp, cp_rank, tensor.device)
    return tensor if cp == 1 else tensor.index_select(seq_dim, positions)


def cp_gathered_to_sequence_order(gathered: torch.Tensor, cp: int) -> torch.Tensor:
    """[cp * local, ...] (every rank's local sequence, in rank order) -> [seq, ...] in position
    order: first halves are chunks 0..cp-1, second halves chunks 2cp-1..cp."""
    halves = gathered.unflatten(0, (cp, 2, -1))
    return torch.cat([halves[:, 0], halves[:, 1].flip(0)]).flatten(0, 1)


def contiguous_part(tensor: torch.Tensor, seq_dim: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The cp_rank-th of cp equal contiguous parts of `tensor` along seq_dim (a view)."""
    n = tensor.shape[seq_dim]
    if n % cp:
        raise ValueError(f"{n} tokens do not split into cp={cp} equal parts")
    return tensor.narrow(seq_dim, cp_rank * (n // cp), n // cp)
