"""M-RoPE position ids (Qwen2-VL and its successors): every token of the LLM sequence gets three
position ids (temporal, height, width). Text tokens count up on all three alike; an image's tokens
(its patch grid after the encoder's spatial merge, row-major) get the text position reached before it
plus their (t, h, w) grid coordinates, and the text after it continues from there plus the larger
side of the merged grid: transformers' `Qwen2_5_VLModel.get_rope_index`; a video's temporal patches
count on the temporal id by its time step (Qwen2.5-VL), or each is placed as an image (Qwen3-VL).

Pure torch on one sample; the data computes it (every rank, from token positions and image grids),
the LLM's rotary embedding reads it (models/vlm.py: GPTModel's "mrope"). Qwen2-VL's M-RoPE gives each
position id a contiguous section of the rotary frequencies; Qwen3-VL interleaves them
(`interleaved_axes`).
"""

import torch


def mrope_positions(seq_len: int, starts: list[int], grids: list[tuple[int, int, int]], merge: int,
                    steps: list | None = None) -> torch.Tensor:
    """LongTensor [3, seq_len]: the position ids of a sequence whose i-th run of vision tokens (t * h *
    w / merge^2 of them, in order) starts at starts[i]; grids: each run's (t, h, w) patch grid before
    the merge; steps: each run's temporal step (a video's time between temporal patches in position
    ids, truncated after the multiplication as transformers does; default 1)."""
    positions = torch.empty(3, seq_len, dtype=torch.long)
    reached = done = 0  # the next position id; the tokens placed
    for start, (t, h, w), step in zip(starts, grids, steps or [1] * len(grids)):
        text = start - done
        positions[:, done:start] = torch.arange(text) + reached
        reached += text
        grid = grid_positions((torch.arange(t) * step).long(), h, w, merge)
        positions[:, start : start + grid.shape[1]] = grid + reached
        reached += max(h, w) // merge
        done = start + grid.shape[1]
    positions[:, done:] = torch.arange(seq_len - done) + reached
    return positions


def grid_positions(times: torch.Tensor, h: int, w: int, merge: int) -> torch.Tensor:
    """LongTensor [3, t * h * w / merge^2]: the (temporal, height, width) ids of a patch grid's merged
    tokens in row-major order, temporal patch k's temporal id times[k]."""
    return torch.stack(torch.meshgrid(times, torch.arange(h // merge), torch.arange(w // merge),
                                      indexing="ij")).flatten(1)


def interleaved_axes(frequencies: int, section) -> torch.Tensor:
    """LongTensor [frequencies]: which position id (0 temporal, 1 height, 2 width) rotates each
    rotary frequency in Qwen3-VL's interleaved M-RoPE: height every third from 1 and width every
    third from 2, within 3 x their sections; the temporal id the rest (transformers'
    Qwen3VLTextRotaryEmbedding.recomposition_frequencies)."""
    axes = torch.zeros(frequencies, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : 3 * section[axis] : 3] = axis
    return axes
