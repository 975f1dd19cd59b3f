"""Boundary routing plan: pure rank and token math, no torch.distributed.

A batch of B samples crosses an edge. Every encoder output row (one image token, projected to the
LLM hidden size) has a global address: (sample, position in the fused LLM sequence). The encoder's
layout says which ranks hold the row; the LLM's input layout says which ranks consume it and where:

- encoder: sample -> encoder DP rank (contiguous slices); its rows sit in that rank's output in sample
  order; every encoder TP rank of that DP rank holds a replica;
- LLM: sample -> LLM DP rank (contiguous slices) and local sample j; the row lands at flat index
  `position * b_local + j` of the rank's [seq, b_local, hidden] input (Megatron's sequence-first
  layout); without sequence parallelism every LLM TP rank of that DP rank consumes it.

Forward, each consumer receives the row once, from one encoder replica (itself if it holds one,
else spread over replicas). Backward, each encoder replica receives the row's gradient once, from
one LLM replica (Megatron's TP backward leaves the same full gradient on every TP rank, so summing
replicas would multiply it by TP).
"""

from dataclasses import dataclass

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


def check_edge_layouts(encoder: ModuleLayout, llm: ModuleLayout) -> None:
    """The axes this boundary serves so far; raises BoundaryError naming the field to change."""
    for module in (encoder, llm):
        for axis in ("cp", "pp"):
            if getattr(module, axis) != 1:
                raise BoundaryError(
                    f"module {module.name}: {axis}={getattr(module, axis)} is not supported at the "
                    f"boundary yet; set {axis}: 1"
                )
    if llm.sp:
        raise BoundaryError(f"module {llm.name}: sp is not supported at the boundary yet; set sp: false")


def _check_batch(batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout) -> None:
    check_edge_layouts(encoder, llm)
    for module in (encoder, llm):
        if batch.num_samples % module.dp:
            raise BoundaryError(
                f"the global batch ({batch.num_samples} samples) is not divisible by module "
                f"{module.name}'s dp={module.dp}; set --global-batch-size to a multiple of {module.dp}"
            )


def _encoder_sources(batch: BoundaryBatch, encoder: ModuleLayout):
    """Per row: the ranks holding it ([R, replicas]) and its index in their output ([R])."""
    samples_per_dp = batch.num_samples // encoder.dp
    row_sample = np.repeat(np.arange(batch.num_samples), batch.rows_per_sample)
    dp = row_sample // samples_per_dp
    # Rows are numbered per encoder DP rank: subtract the rows of the DP ranks before it.
    rows_per_dp = batch.rows_per_sample.reshape(encoder.dp, samples_per_dp).sum(axis=1)
    dp_start = np.concatenate([[0], np.cumsum(rows_per_dp)[:-1]])
    index = np.arange(batch.num_rows) - dp_start[dp]
    ranks = encoder.first_rank + np.arange(encoder.tp)[None, :] + encoder.tp * dp[:, None]
    return ranks, index, rows_per_dp


def _llm_consumers(batch: BoundaryBatch, llm: ModuleLayout):
    """Per row: the LLM ranks consuming it ([R, replicas]) and its slot in their input ([R])."""
    b_local = batch.num_samples // llm.dp
    row_sample = np.repeat(np.arange(batch.num_samples), batch.rows_per_sample)
    dp, local_sample = np.divmod(row_sample, b_local)
    slot = batch.positions * b_local + local_sample
    ranks = llm.first_rank + np.arange(llm.tp)[None, :] + llm.tp * dp[:, None]
    return ranks, slot


def _pick_replica(replicas: np.ndarray, peer: np.ndarray) -> np.ndarray:
    """Column of `replicas` that serves `peer`: the peer itself if it holds a replica (no bytes
    move), else spread over the replicas by row and peer."""
    rows, width = replicas.shape
    is_peer = replicas == peer[:, None]
    spread = (np.arange(rows) + peer) % width
    return np.where(is_peer.any(axis=1), is_peer.argmax(axis=1), spread)


def _routes_for(rank, world_size, src, src_index, dst, dst_index) -> Routes:
    """Filter a transfer table (one entry per row delivery) to `rank`'s sends and receives.

    Both ends order a peer's rows by transfer id, so the k-th row sent is the k-th row received.
    """
    sends = np.flatnonzero(src == rank)
    sends = sends[np.argsort(dst[sends], kind="stable")]
    recvs = np.flatnonzero(dst == rank)
    recvs = recvs[np.argsort(src[recvs], kind="stable")]
    return Routes(
        send_counts=np.bincount(dst[sends], minlength=world_size),
        send_index=src_index[sends],
        recv_counts=np.bincount(src[recvs], minlength=world_size),
        recv_index=dst_index[recvs],
    )


def plan_edge(
    batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout, rank: int, world_size: int
) -> RankPlan:
    """`rank`'s forward and backward routes for one edge and one batch."""
    _check_batch(batch, encoder, llm)
    enc_ranks, enc_index, rows_per_dp = _encoder_sources(batch, encoder)
    llm_ranks, llm_slot = _llm_consumers(batch, llm)
    rows = np.arange(batch.num_rows)

    # Forward: one delivery per (row, consuming LLM rank), from one encoder replica.
    fwd_row = np.repeat(rows, llm_ranks.shape[1])
    fwd_dst = llm_ranks.reshape(-1)
    fwd_src = enc_ranks[fwd_row, _pick_replica(enc_ranks[fwd_row], fwd_dst)]
    forward = _routes_for(rank, world_size, fwd_src, enc_index[fwd_row], fwd_dst, llm_slot[fwd_row])

    # Backward: one delivery per (row, encoder replica), from one LLM replica.
    bwd_row = np.repeat(rows, enc_ranks.shape[1])
    bwd_dst = enc_ranks.reshape(-1)
    bwd_src = llm_ranks[bwd_row, _pick_replica(llm_ranks[bwd_row], bwd_dst)]
    backward = _routes_for(rank, world_size, bwd_src, llm_slot[bwd_row], bwd_dst, enc_index[bwd_row])

    enc_coords, llm_coords = encoder.coords(rank), llm.coords(rank)
    return RankPlan(
        rank=rank,
        forward=forward,
        backward=backward,
        num_source_rows=int(rows_per_dp[enc_coords["dp"]]) if enc_coords else 0,
        num_dest_slots=batch.seq_len * (batch.num_samples // llm.dp) if llm_coords else 0,
    )
