"""The row-by-row boundary planner that plan.py's run-based one replaced, kept as the reference its
routes must equal element for element (tests/test_boundary.py): every array is computed per row,
which makes it simple to read and slow on large batches."""

import numpy as np

from megatron_hetero.boundary.plan import BoundaryBatch
from megatron_hetero.spec.layout import ModuleLayout


class _Rows:
    """Addresses of every row of the batch (vectorized over rows, in row order)."""

    def __init__(self, batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout):
        sample = np.repeat(np.arange(batch.num_samples), batch.rows_per_sample)
        item = np.repeat(np.arange(len(batch.item_rows)), batch.item_rows)
        item_first = np.concatenate([[0], np.cumsum(batch.item_rows)[:-1]])
        k = np.arange(batch.num_rows) - item_first[item]  # index of the row within its item

        # Encoder: DP by item, CP by contiguous parts of the item's rows, last PP stage.
        e = encoder
        enc_dp = sample // (batch.num_samples // e.dp) if batch.item_dp is None else batch.item_dp[item]
        enc_cp = ((k + 1) * e.cp - 1) // np.maximum(batch.item_rows[item], 1)
        self.enc_group = enc_dp * e.cp + enc_cp  # (dp, cp) holding the row
        self.enc_base = e.first_rank + e.tp * (self.enc_group + e.cp * e.dp * (e.pp - 1))
        self.enc_width = e.tp

        # LLM: DP by sample, CP by load-balanced chunks, TP parts with SP, first PP stage.
        b_local = batch.num_samples // llm.dp
        llm_dp, local_sample = np.divmod(sample, b_local)
        if llm.cp > 1:
            chunk_len = batch.seq_len // (2 * llm.cp)
            chunk, offset = np.divmod(batch.positions, chunk_len)
            llm_cp = np.where(chunk < llm.cp, chunk, 2 * llm.cp - 1 - chunk)
            local_pos = np.where(chunk < llm.cp, 0, chunk_len) + offset
        else:
            llm_cp, local_pos = np.zeros_like(batch.positions), batch.positions
        if llm.sp:
            llm_tp, local_pos = np.divmod(local_pos, batch.seq_len // llm.cp // llm.tp)
            self.llm_base = llm.first_rank + llm_tp + llm.tp * (llm_cp + llm.cp * llm_dp)
            self.llm_width = 1
        else:
            self.llm_base = llm.first_rank + llm.tp * (llm_cp + llm.cp * llm_dp)
            self.llm_width = llm.tp
        self.slot = local_sample * (batch.seq_len // llm.cp // (llm.tp if llm.sp else 1)) + local_pos


def _index_within(keys: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements share its key."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    starts = np.flatnonzero(np.r_[True, sorted_keys[1:] != sorted_keys[:-1]])
    index = np.empty_like(order)
    index[order] = np.arange(len(keys)) - np.repeat(starts, np.diff(np.r_[starts, len(keys)]))
    return index


def _pick(base, width: int, nth: np.ndarray, peer: np.ndarray) -> np.ndarray:
    """The replica (of ranks base..base+width-1) that serves `peer` its nth row from this replica
    set: the peer itself if it holds one (no bytes move), else the replicas in turn."""
    holds = (peer >= base) & (peer < base + width)
    return np.where(holds, peer, base + (nth + peer) % width)


def _holder_rows(base: np.ndarray, width: int, rank: int) -> np.ndarray:
    """Rows of which `rank` is one of the replicas base..base+width-1, in row order."""
    return np.flatnonzero((rank >= base) & (rank < base + width))


def _sends(rank, world_size, src_base, src_width, dst_base, dst_width, src_index, dst_index):
    """rank's deliveries as a source: every (held row, destination) it is picked to serve, ordered
    by destination, then destination index (the receiver's order)."""
    held = _holder_rows(src_base, src_width, rank)
    row = np.repeat(held, dst_width)
    dst = dst_base[row] + np.tile(np.arange(dst_width), len(held))
    # Held rows share one replica set: number each destination's rows from it in row order.
    mine = _pick(src_base[row], src_width, _index_within(dst), dst) == rank
    row, dst = row[mine], dst[mine]
    order = np.lexsort((dst_index[row], dst))
    return np.bincount(dst, minlength=world_size), src_index[row[order]]


def _recvs(rank, world_size, src_base, src_width, dst_base, dst_width, dst_index):
    """rank's deliveries as a destination: one per row it holds a slot for, ordered by source,
    then destination index."""
    row = _holder_rows(dst_base, dst_width, rank)
    # Number this rank's rows per source replica set, in row order: the senders' numbering.
    src = _pick(src_base[row], src_width, _index_within(src_base[row]), rank)
    order = np.lexsort((dst_index[row], src))
    return np.bincount(src, minlength=world_size), dst_index[row[order]]


def row_routes(batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout, rank: int,
               world_size: int) -> dict:
    """`rank`'s forward and backward routes, row by row: direction -> (send_counts, send_index,
    recv_counts, recv_index)."""
    rows = _Rows(batch, encoder, llm)
    enc_index = _index_within(rows.enc_group)
    enc = (rows.enc_base, rows.enc_width)
    dst = (rows.llm_base, rows.llm_width)
    return {
        "forward": (*_sends(rank, world_size, *enc, *dst, enc_index, rows.slot),
                    *_recvs(rank, world_size, *enc, *dst, rows.slot)),
        "backward": (*_sends(rank, world_size, *dst, *enc, rows.slot, enc_index),
                     *_recvs(rank, world_size, *dst, *enc, enc_index)),
    }
