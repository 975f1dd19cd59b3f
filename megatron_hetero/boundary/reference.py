"""The single-process re-layout the boundary must equal: dense whole-batch tensors sliced the way
Megatron slices a batch. Independent of plan.py on purpose; used by the tests and by
tools/verify_layout.py."""

import numpy as np
import torch

from megatron_hetero.boundary.plan import BoundaryBatch
from megatron_hetero.spec.layout import ModuleLayout


def row_samples(batch: BoundaryBatch) -> torch.Tensor:
    return torch.as_tensor(np.repeat(np.arange(batch.num_samples), batch.rows_per_sample))


def reference_input(rows: torch.Tensor, batch: BoundaryBatch) -> torch.Tensor:
    """The whole batch's LLM input [seq, B, h] with every row at its address, zeros elsewhere."""
    full = rows.new_zeros(batch.seq_len, batch.num_samples, rows.shape[1])
    full[torch.as_tensor(batch.positions), row_samples(batch)] = rows
    return full


def at_addresses(full: torch.Tensor, batch: BoundaryBatch) -> torch.Tensor:
    """[rows, h]: the entries of a [seq, B, h] tensor at every row's address (row order)."""
    return full[torch.as_tensor(batch.positions), row_samples(batch)]


def llm_share(full: torch.Tensor, layout: ModuleLayout, rank: int) -> torch.Tensor:
    """What an LLM rank holds of a [seq, B, h] tensor, as its boundary slots [b_local * seq_local, h]
    (sample-major): its
    DP samples, its CP chunks r and 2cp-1-r (get_batch_on_this_cp_rank), its SP part; nothing off
    the first PP stage or outside the module."""
    c = layout.coords(rank)
    if c is None or c["pp"] != 0:
        return full[:0, 0]
    x = full[:, layout.dp_samples(full.shape[1], c["dp"])]
    if layout.cp > 1:
        chunks = x.chunk(2 * layout.cp)
        x = torch.cat([chunks[c["cp"]], chunks[2 * layout.cp - 1 - c["cp"]]])
    if layout.sp:
        x = x.chunk(layout.tp)[c["tp"]]
    return x.transpose(0, 1).reshape(-1, full.shape[2])


def encoder_share(rows: torch.Tensor, batch: BoundaryBatch, layout: ModuleLayout, rank: int) -> torch.Tensor:
    """The rows an encoder rank outputs (row order): its DP rank's items (batch.item_dp, else the
    items of its contiguous slice of samples), each item's CP part [c*n//cp, (c+1)*n//cp); nothing
    off the last PP stage or outside the module."""
    c = layout.coords(rank)
    if c is None or c["pp"] != layout.pp - 1:
        return rows[:0]
    mine = batch.items_of(c["dp"], layout.dp)
    starts = np.concatenate([[0], np.cumsum(batch.item_rows)])
    parts = [rows[:0]]
    for i in np.flatnonzero(mine):
        n = int(batch.item_rows[i])
        lo, hi = c["cp"] * n // layout.cp, (c["cp"] + 1) * n // layout.cp
        parts.append(rows[starts[i] + lo : starts[i] + hi])
    return torch.cat(parts)
