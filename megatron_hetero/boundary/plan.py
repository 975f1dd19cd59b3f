"""Boundary routing plan: pure rank and token math, no torch.distributed.

A batch of B samples crosses an edge. Every encoder output row (one image token, projected to the
LLM hidden size) has a global address: (sample, position in the fused LLM sequence).

Who holds a row (encoder layout):
- sample -> encoder DP rank (contiguous slices of the batch);
- encoder CP splits each sample's rows into cp contiguous parts (rows [c*n//cp, (c+1)*n//cp));
- only the last encoder PP stage produces rows; every encoder TP rank holds a replica;
- a rank's output lists its rows in sample order, then row order.

Who consumes a row, and where (LLM input layout, Megatron's):
- sample -> LLM DP rank (contiguous slices) and local sample j;
- position -> CP rank with load balancing: the sequence is cut into 2*cp chunks and CP rank r holds
  chunks r and 2*cp-1-r (megatron-core's get_batch_on_this_cp_rank);
- with sequence parallelism the CP-local sequence is cut again into tp contiguous parts, one per TP
  rank; without it every TP rank consumes the row;
- only the first LLM PP stage consumes rows;
- the row lands at flat index `local_position * b_local + j` of the rank's [seq_local, b_local, h]
  input (Megatron's sequence-first layout).

Forward, each consumer receives the row once, from one encoder replica (itself if it holds one, else
spread over the replicas by row). Backward, each encoder replica receives the row's gradient once,
from one consuming LLM rank (without SP every LLM TP rank holds the same full gradient after
Megatron's TP backward, so summing replicas would multiply it by TP).

Each rank computes only its own sends and receives, from metadata every rank has.
"""

from dataclasses import dataclass, field

import numpy as np

from megatron_hetero.layout import ModuleLayout


class BoundaryError(ValueError):
    """A batch or layout pair that the boundary cannot serve; one line naming what to change."""


@dataclass(frozen=True)
class BoundaryBatch:
    """Metadata of the rows crossing an edge for one batch; identical on every rank.

    rows_per_sample: [B] encoder rows of each sample (0 for a sample without images).
    positions: [sum(rows_per_sample)] fused-sequence position of each row, samples in order.
    seq_len: the fused LLM sequence length (the same for every sample of the batch).
    """

    rows_per_sample: np.ndarray
    positions: np.ndarray
    seq_len: int

    def __post_init__(self):
        rows = np.asarray(self.rows_per_sample, dtype=np.int64)
        positions = np.asarray(self.positions, dtype=np.int64)
        object.__setattr__(self, "rows_per_sample", rows)
        object.__setattr__(self, "positions", positions)
        assert rows.ndim == 1 and (rows >= 0).all(), "rows_per_sample must be non-negative counts"
        assert positions.shape == (int(rows.sum()),), "one position per row"
        assert positions.size == 0 or (0 <= positions.min() and positions.max() < self.seq_len)

    @property
    def num_samples(self) -> int:
        return len(self.rows_per_sample)

    @property
    def num_rows(self) -> int:
        return len(self.positions)


@dataclass(frozen=True)
class Routes:
    """One rank's side of one exchange: what it sends to and receives from every rank.

    send_counts[r] rows go to rank r, gathered from the local source at send_index (peers in rank
    order); recv_counts[r] rows come from rank r and land at recv_index of the local destination.
    """

    send_counts: np.ndarray
    send_index: np.ndarray
    recv_counts: np.ndarray
    recv_index: np.ndarray

    def bytes_sent_off_rank(self, rank: int, row_bytes: int) -> int:
        return int(self.send_counts.sum() - self.send_counts[rank]) * row_bytes


@dataclass(frozen=True)
class RankPlan:
    """A rank's routes for an edge: forward rows and backward gradients, and its buffer sizes."""

    rank: int
    forward: Routes
    backward: Routes
    num_source_rows: int  # rows of this rank's encoder output (0 if it holds no encoder output)
    num_dest_slots: int  # seq * b_local slots of this rank's LLM input (0 if it consumes nothing)
    # Execution state derived from the routes (index tensors per device), filled by exchange.py.
    cache: dict = field(default_factory=dict, compare=False, repr=False)


def check_edge_layouts(encoder: ModuleLayout, llm: ModuleLayout) -> None:
    """Layout pairs the boundary cannot serve; raises BoundaryError naming the field to change."""
    if encoder.role != "encoder" or llm.role != "llm":
        raise BoundaryError(
            f"edge {encoder.name} -> {llm.name}: an edge goes from an encoder into the llm; "
            f"fix the edges list"
        )
    if encoder.sp:
        raise BoundaryError(f"module {encoder.name}: sp on an encoder is not supported; set sp: false")


def _check_batch(batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout) -> None:
    check_edge_layouts(encoder, llm)
    for module in (encoder, llm):
        if batch.num_samples % module.dp:
            raise BoundaryError(
                f"the batch ({batch.num_samples} samples) is not divisible by module "
                f"{module.name}'s dp={module.dp}; use a batch size that is a multiple of {module.dp}"
            )
    if llm.cp > 1 and batch.seq_len % (2 * llm.cp):
        raise BoundaryError(
            f"the fused sequence length {batch.seq_len} is not divisible by 2*cp = {2 * llm.cp} "
            f"(module {llm.name}: cp={llm.cp}); pad the sequence (--seq-length) to a multiple of "
            f"{2 * llm.cp}"
        )
    if llm.sp and (batch.seq_len // llm.cp) % llm.tp:
        multiple = (2 if llm.cp > 1 else 1) * llm.cp * llm.tp
        raise BoundaryError(
            f"the fused sequence length {batch.seq_len} does not split over cp={llm.cp} and tp={llm.tp} "
            f"with sp (module {llm.name}); pad the sequence (--seq-length) to a multiple of {multiple}"
        )


class _Rows:
    """Addresses of every row of the batch (vectorized over rows, in row order)."""

    def __init__(self, batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout):
        n = batch.rows_per_sample
        sample = np.repeat(np.arange(batch.num_samples), n)
        first_row = np.concatenate([[0], np.cumsum(n)[:-1]])
        k = np.arange(batch.num_rows) - first_row[sample]  # index of the row within its sample

        # Encoder: DP by sample, CP by contiguous parts of the sample's rows, last PP stage.
        e = encoder
        enc_dp = sample // (batch.num_samples // e.dp)
        enc_cp = ((k + 1) * e.cp - 1) // np.maximum(n[sample], 1)
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
        self.slot = local_pos * b_local + local_sample


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
    # Destination-index order lets a receiver whose rows fill a slot range take them in place.
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


def _encoder_index(rows: _Rows, encoder: ModuleLayout) -> tuple[np.ndarray, np.ndarray]:
    """Each row's index in its holders' output, and the row count of every (dp, cp) group."""
    return _index_within(rows.enc_group), np.bincount(rows.enc_group, minlength=encoder.dp * encoder.cp)


def plan_edge(
    batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout, rank: int, world_size: int
) -> RankPlan:
    """`rank`'s forward and backward routes for one edge and one batch (or microbatch)."""
    _check_batch(batch, encoder, llm)
    rows = _Rows(batch, encoder, llm)
    enc_index, group_rows = _encoder_index(rows, encoder)
    enc = (rows.enc_base, rows.enc_width)
    dst = (rows.llm_base, rows.llm_width)
    forward = Routes(
        *_sends(rank, world_size, *enc, *dst, enc_index, rows.slot),
        *_recvs(rank, world_size, *enc, *dst, rows.slot),
    )
    backward = Routes(
        *_sends(rank, world_size, *dst, *enc, rows.slot, enc_index),
        *_recvs(rank, world_size, *dst, *enc, enc_index),
    )
    enc_coords, llm_coords = encoder.coords(rank), llm.coords(rank)
    num_source_rows = 0
    if enc_coords and enc_coords["pp"] == encoder.pp - 1:
        num_source_rows = int(group_rows[enc_coords["dp"] * encoder.cp + enc_coords["cp"]])
    num_dest_slots = 0
    if llm_coords and llm_coords["pp"] == 0:
        seq_local = batch.seq_len // llm.cp // (llm.tp if llm.sp else 1)
        num_dest_slots = seq_local * (batch.num_samples // llm.dp)
    return RankPlan(rank, forward, backward, num_source_rows, num_dest_slots)


class PlanCache:
    """Plans by batch metadata: with fixed image sizes every step reuses one plan, and with it the
    index tensors its execution uploads once."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._plans: dict = {}

    def plan(self, batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout, rank: int,
             world_size: int) -> RankPlan:
        key = (batch.rows_per_sample.tobytes(), batch.positions.tobytes(), batch.seq_len,
               encoder, llm, rank, world_size)
        if key not in self._plans:
            if len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)))  # oldest first
            self._plans[key] = plan_edge(batch, encoder, llm, rank, world_size)
        return self._plans[key]
