"""Boundary routing plan: pure rank and token math, no torch.distributed.

A batch of B samples crosses an edge. Every encoder output row (one image token, projected to the
LLM hidden size) has a global address: (sample, position in the fused LLM sequence).

Who holds a row (encoder layout):
- item (an image or tile, a clip) -> encoder DP rank: the batch's `item_dp`, balanced by cost
  (balance.py) and independent of the LLM's DP split; without it, contiguous slices of the samples;
- encoder CP splits each item's rows into cp contiguous parts (rows [c*n//cp, (c+1)*n//cp));
- only the last encoder PP stage produces rows; every encoder TP rank holds a replica;
- a rank's output lists its items' rows in item order, then row order.

Who consumes a row, and where (LLM input layout, Megatron's):
- sample -> LLM DP rank (contiguous slices) and local sample j;
- position -> CP rank with load balancing: the sequence is cut into 2*cp chunks and CP rank r holds
  chunks r and 2*cp-1-r (megatron-core's get_batch_on_this_cp_rank);
- with sequence parallelism the CP-local sequence is cut again into tp contiguous parts, one per TP
  rank; without it every TP rank consumes the row;
- only the first LLM PP stage consumes rows;
- the row lands at slot `j * seq_local + local_position` of the rank's [b_local, seq_local, h]
  boundary input: sample-major, as the encoders' rows are, so that a sample's rows travel as one
  contiguous block at both ends (no gather before sending, no scatter after receiving); the LLM
  reads it transposed into Megatron's sequence-first [seq_local, b_local, h] in its merge with the
  text embedding.

Forward, each consumer receives the row once, from one encoder replica (itself if it holds one, else
spread over the replicas by row). Backward, each encoder replica receives the row's gradient once,
from one consuming LLM rank (without SP every LLM TP rank holds the same full gradient after
Megatron's TP backward, so summing replicas would multiply it by TP).

Each rank computes only its own sends and receives, from metadata every rank has. It plans per
segment, not per row: a run of rows at consecutive positions (one image's tokens), cut where the
encoder CP part, the LLM CP chunk or the SP part changes, keeps one holder set and one consumer set
and steps its encoder index and its slot by 1. The cost grows with the segments (about
the images) plus the rank's own index arrays, which are spelled out per row at the end.
"""

import hashlib
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import cached_property
from itertools import zip_longest

import numpy as np

from megatron_hetero.spec import rules
from megatron_hetero.spec.layout import ModuleLayout, dp_rank_of


class BoundaryError(ValueError):
    """A batch or layout pair that the boundary cannot serve; one line naming what to change."""


class BoundaryMismatch(BoundaryError):
    """Ranks hold different boundary metadata for one batch (a data bug): their plans would not
    pair up, and the exchange would hang or put rows in the wrong slots."""


@dataclass(frozen=True)
class BoundaryBatch:
    """Metadata of the rows crossing an edge for one batch; identical on every rank.

    rows_per_sample: [B] encoder rows of each sample (0 for a sample without images).
    positions: [sum(rows_per_sample)] fused-sequence position of each row, samples in order.
    seq_len: the fused LLM sequence length (the same for every sample of the batch).
    item_rows: [items] rows of each item the encoder runs on (an image or tile, a clip), a sample's
      items in order; None: one item per sample.
    item_dp: [items] the encoder DP rank that encodes each item (balance.assign_items); None: each
      DP rank takes a contiguous slice of the samples, as Megatron splits a batch.
    """

    rows_per_sample: np.ndarray
    positions: np.ndarray
    seq_len: int
    item_rows: np.ndarray | None = None
    item_dp: np.ndarray | None = None

    def __post_init__(self):
        rows = np.asarray(self.rows_per_sample, dtype=np.int64)
        positions = np.asarray(self.positions, dtype=np.int64)
        item_rows = rows if self.item_rows is None else np.asarray(self.item_rows, dtype=np.int64)
        object.__setattr__(self, "rows_per_sample", rows)
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "item_rows", item_rows)
        assert rows.ndim == 1 and (rows >= 0).all(), "rows_per_sample must be non-negative counts"
        assert positions.shape == (int(rows.sum()),), "one position per row"
        assert positions.size == 0 or (0 <= positions.min() and positions.max() < self.seq_len)
        assert (item_rows >= 0).all() and np.isin(np.cumsum(rows), np.append(np.cumsum(item_rows), 0)).all(), \
            "items lie within samples"
        if self.item_dp is not None:
            item_dp = np.asarray(self.item_dp, dtype=np.int64)
            object.__setattr__(self, "item_dp", item_dp)
            assert item_dp.shape == item_rows.shape and (item_dp >= 0).all(), "one DP rank per item"

    @property
    def num_samples(self) -> int:
        return len(self.rows_per_sample)

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    def items_of(self, dp_rank: int, dp: int) -> np.ndarray:
        """Mask [items] of the items an encoder's DP rank `dp_rank` (of `dp`) encodes."""
        if self.item_dp is None:  # one item per sample, contiguous slices of the samples
            return dp_rank_of(np.arange(self.num_samples), self.num_samples, dp) == dp_rank
        return self.item_dp == dp_rank

    @cached_property
    def item_starts(self) -> np.ndarray:
        """First row of every item."""
        return np.cumsum(self.item_rows) - self.item_rows

    @cached_property
    def run_starts(self) -> np.ndarray:
        """First row of every run: rows of one item at consecutive positions (one image's tokens).
        The one pass over all rows; the plan works on runs."""
        breaks = np.flatnonzero(np.diff(self.positions) != 1) + 1
        return np.union1d(self.item_starts[self.item_starts < self.num_rows], breaks)

    @cached_property
    def key(self) -> bytes:
        """The metadata, exactly, in O(items + runs) bytes: a run's positions follow from its
        first one (the counts first, so that the arrays' lengths are known)."""
        item_dp = np.array([-1]) if self.item_dp is None else self.item_dp
        header = np.array([self.seq_len, self.num_samples, len(self.item_rows), len(self.run_starts)],
                          dtype=np.int64)
        return b"".join(a.tobytes() for a in (header, self.rows_per_sample, self.item_rows, item_dp,
                                               self.run_starts, self.positions[self.run_starts]))


@dataclass(frozen=True)
class _Index:
    """An index array as arithmetic runs: first[i] + step[i] * r for r < rows[i], run after run;
    with `by` (the runs' keys, where runs interleave), reordered by key."""

    first: np.ndarray
    step: np.ndarray
    rows: np.ndarray
    by: "_Index | None" = None

    def spell(self) -> np.ndarray:
        head = np.cumsum(self.rows) - self.rows
        index = (np.repeat(self.first - head * self.step, self.rows)
                 + np.repeat(self.step, self.rows) * np.arange(int(self.rows.sum())))
        return index if self.by is None else index[np.argsort(self.by.spell(), kind="stable")]


@dataclass(frozen=True)
class Routes:
    """One rank's side of one exchange: what it sends to and receives from every rank.

    send_counts[r] rows go to rank r, gathered from the local source at send_index (peers in rank
    order); recv_counts[r] rows come from rank r and land at recv_index of the local destination.
    The index arrays are planned as runs and spelled out row by row on first use (the exchange
    does once per plan), so that planning costs what the runs cost.
    """

    send_counts: np.ndarray
    recv_counts: np.ndarray
    sends: _Index = field(repr=False)
    recvs: _Index = field(repr=False)
    # The off-rank rows as messages [peer, source index, destination index, rows], each a
    # contiguous range at both ends, in the order both ends post them (the same list at the sender
    # and the receiver of a pair); None where some rows are not contiguous at both ends.
    # pair_messages: the most messages between two ranks of the edge (the same on every rank).
    send_messages: np.ndarray | None = field(default=None, repr=False)
    recv_messages: np.ndarray | None = field(default=None, repr=False)
    pair_messages: int = 0

    @cached_property
    def send_index(self) -> np.ndarray:
        return self.sends.spell()

    @cached_property
    def recv_index(self) -> np.ndarray:
        return self.recvs.spell()

    def bytes_sent_off_rank(self, rank: int, row_bytes: int) -> int:
        return int(self.send_counts.sum() - self.send_counts[rank]) * row_bytes


@dataclass(frozen=True)
class Gather:
    """An edge whose forward is one all-gather per LLM TP group (colocated.py's fast path): each
    rank of the group (`ranks`, the LLM's TP ranks of one (dp, cp) on its first stage) is the
    only holder of `rows` encoder rows, and its LLM side's rows are the members' rows concatenated
    in rank order. The backward routes of such an edge stay on each rank (every member consumes
    its own rows, so it is the one replica that returns their gradients): the all-gather's adjoint
    under the one-replica rule is the slice of a member's own rows."""

    ranks: tuple[int, ...]
    rows: int


@dataclass(frozen=True)
class RankPlan:
    """A rank's routes for an edge: forward rows and backward gradients, and its buffer sizes."""

    rank: int
    forward: Routes
    backward: Routes
    num_source_rows: int  # rows of this rank's encoder output (0 if it holds no encoder output)
    num_dest_slots: int  # seq * b_local slots of this rank's LLM input (0 if it consumes nothing)
    # An encoder replicated over cp: each replica gets back the gradients of some of its rows only
    # (the others' are zero there; their sum over the replicas is the rows' gradient).
    partial_gradients: bool = False
    # The forward as an all-gather over this rank's LLM TP group, where the edge is one (_gather);
    # None: the routes only.
    gather: Gather | None = None
    # Execution state derived from the routes (index tensors per device), filled by transfer.py.
    cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_dest_rows(self) -> int:
        """Rows of this rank's LLM side: the slots the boundary fills, one row each (rows.py)."""
        return int(self.forward.recv_counts.sum())


def check_edge_layouts(encoder: ModuleLayout, llm: ModuleLayout) -> None:
    """Layout pairs the boundary cannot serve; raises BoundaryError naming the field to change."""
    rules.check(BoundaryError, rules.edge_problem(encoder, llm))


def _check_batch(batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout) -> None:
    """Samples split over the LLM's DP ranks (and the encoder's, without an item assignment), items
    assigned to the encoder's DP ranks, the sequence over the LLM's CP chunks and SP parts."""
    what = f"the batch ({batch.num_samples} samples)"
    split = (llm,) if batch.item_dp is not None else (encoder, llm)
    assigned = None
    if batch.item_dp is not None and batch.item_dp.size and batch.item_dp.max() >= encoder.dp:
        assigned = (f"the batch assigns items to DP rank {batch.item_dp.max()} of module {encoder.name}, which "
                    f"has dp={encoder.dp}; assign items for dp={encoder.dp} (boundary.assign_items)")
    rules.check(BoundaryError, rules.edge_problem(encoder, llm), assigned,
                *(rules.dp_split_problem(what, batch.num_samples, module) for module in split),
                rules.sequence_problem(batch.seq_len, llm))


@dataclass(frozen=True)
class _Side:
    """One end of the rows' journey, per segment: the replica set holding (encoder) or consuming
    (LLM) them, ranks base..base+width-1, and the index of the segment's rows there: index +
    i * unit for its row i, below span."""

    base: np.ndarray
    width: int
    index: np.ndarray
    unit: int
    span: int


class _Segments:
    """The batch as segments: runs of rows cut again wherever the encoder CP part, the LLM CP
    chunk or the SP part changes. Within a segment every row has the same holders and consumers,
    and its row i has encoder index `first + i` and LLM input slot `first + i`: the plan
    is computed per segment."""

    def __init__(self, batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout):
        n, num_rows = batch.rows_per_sample, batch.num_rows
        item_first, item_n = batch.item_starts, batch.item_rows
        runs = batch.run_starts
        cuts = [runs]
        if encoder.cp > 1 and not encoder.cp_replicated:  # encoder CP part c of an item: rows [c*n//cp, (c+1)*n//cp)
            cuts.append((item_first[:, None] + np.arange(1, encoder.cp) * item_n[:, None] // encoder.cp).ravel())
        pieces, coord = runs, batch.positions[runs]
        chunk_len = batch.seq_len // (2 * llm.cp)
        if llm.cp > 1:
            cuts.append(_crossings(runs, coord, _lengths(runs, num_rows), chunk_len))
            pieces = np.union1d(runs, cuts[-1])  # each within one chunk: its local position runs on
            chunk, offset = np.divmod(batch.positions[pieces], chunk_len)
            coord = np.where(chunk < llm.cp, 0, chunk_len) + offset
        if llm.sp:
            cuts.append(_crossings(pieces, coord, _lengths(pieces, num_rows), batch.seq_len // llm.cp // llm.tp))
        starts = np.unique(np.concatenate(cuts))
        starts = starts[starts < num_rows]  # a trailing sample without rows cuts nothing
        self.count = _lengths(starts, num_rows)
        sample = np.searchsorted(np.cumsum(n), starts, side="right")
        item = np.searchsorted(np.cumsum(item_n), starts, side="right")
        k = starts - item_first[item]  # the segment's first row within its item
        positions = batch.positions[starts]

        # LLM: DP by sample, CP by load-balanced chunks, TP parts with SP, first PP stage.
        b_local = batch.num_samples // llm.dp
        llm_dp = dp_rank_of(sample, batch.num_samples, llm.dp)
        local_sample = sample - llm_dp * b_local
        if llm.cp > 1:
            chunk, offset = np.divmod(positions, chunk_len)
            llm_cp = np.where(chunk < llm.cp, chunk, 2 * llm.cp - 1 - chunk)
            local_pos = np.where(chunk < llm.cp, 0, chunk_len) + offset
        else:
            llm_cp, local_pos = np.zeros_like(positions), positions
        if llm.sp:
            llm_tp, local_pos = np.divmod(local_pos, batch.seq_len // llm.cp // llm.tp)
            base, width = llm.first_rank + llm_tp + llm.tp * (llm_cp + llm.cp * llm_dp), 1
        else:
            base, width = llm.first_rank + llm.tp * (llm_cp + llm.cp * llm_dp), llm.tp
        seq_local = batch.seq_len // llm.cp // (llm.tp if llm.sp else 1)
        self.llm = _Side(base, width, local_sample * seq_local + local_pos, 1, batch.seq_len * b_local)

        enc_dp = dp_rank_of(sample, batch.num_samples, encoder.dp) if batch.item_dp is None else batch.item_dp[item]
        enc_cp = ((k + 1) * encoder.cp - 1) // np.maximum(item_n[item], 1)
        self._encoder_sides(encoder, enc_dp, enc_cp, llm_cp, num_rows)

    def _encoder_sides(self, e: ModuleLayout, enc_dp, enc_cp, llm_cp, num_rows: int) -> None:
        """The encoder's end, per segment: DP by item, CP by contiguous parts of the item's rows, the
        last PP stage. `encoder` holds the rows (forward), `encoder_grads` takes their gradients
        (backward): the same replicas, but for an encoder replicated over cp, whose cp ranks all
        hold the (dp) group's rows and each takes back the gradients of the rows consumed by its LLM
        CP rank (llm cp mod the encoder's cp), so that a row's gradient reaches one of them."""
        if e.cp_replicated:
            self.enc_group = enc_dp
            last_stage = e.first_rank + e.tp * e.cp * (enc_dp + e.dp * (e.pp - 1))
            enc_index = _offset_within(self.enc_group, self.count)
            self.encoder = _Side(last_stage, e.tp * e.cp, enc_index, 1, num_rows)
            self.encoder_grads = _Side(last_stage + e.tp * (llm_cp % e.cp), e.tp, enc_index, 1, num_rows)
            return
        self.enc_group = enc_dp * e.cp + enc_cp  # (dp, cp) holding the rows
        enc_index = _offset_within(self.enc_group, self.count)  # the group's rows in row order
        self.encoder = self.encoder_grads = _Side(
            e.first_rank + e.tp * (self.enc_group + e.cp * e.dp * (e.pp - 1)), e.tp, enc_index, 1, num_rows)


def _lengths(starts: np.ndarray, end: int) -> np.ndarray:
    """Lengths of the pieces that start at `starts` and cover rows up to `end`."""
    return np.diff(np.append(starts, end))


def _crossings(rows: np.ndarray, coord: np.ndarray, length: np.ndarray, unit: int) -> np.ndarray:
    """Rows inside pieces (first row `rows`, `length` rows) at which a coordinate that starts at
    `coord` and grows by one per row reaches a multiple of `unit`."""
    first, last = coord // unit + 1, (coord + length - 1) // unit
    k = np.maximum(last - first + 1, 0)
    piece = np.repeat(np.arange(len(rows)), k)
    multiple = first[piece] + _ramps(k)
    return rows[piece] + multiple * unit - coord[piece]


def _ramps(count: np.ndarray) -> np.ndarray:
    """0..count[i]-1 for every i, concatenated."""
    return np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)


def _offset_within(keys: np.ndarray, count: np.ndarray) -> np.ndarray:
    """For each element, the total count of the earlier elements that share its key."""
    order = np.argsort(keys, kind="stable")
    sorted_keys, before = keys[order], np.cumsum(count[order]) - count[order]
    new_key = np.flatnonzero(np.diff(sorted_keys, prepend=-1))  # keys are >= 0
    offset = np.empty_like(count)
    offset[order] = before - np.repeat(before[new_key], np.diff(np.append(new_key, len(keys))))
    return offset


@dataclass(frozen=True)
class _Deliveries:
    """Rows moving in one direction, as (segment, source rank, destination rank) triples, each
    taking `rows` rows of its segment: first, first + step, ..."""

    segment: np.ndarray
    source: np.ndarray
    dest: np.ndarray
    first: np.ndarray
    step: np.ndarray
    rows: np.ndarray

    def take(self, which: np.ndarray) -> "_Deliveries":
        """The deliveries picked by `which` (a mask or positions)."""
        return _Deliveries(*(a[which] for a in vars(self).values()))

    def index(self, side: _Side, peer: np.ndarray | None = None) -> _Index:
        """The rows' indices on `side` (offset by peer * side.span when `peer` is given)."""
        first = side.index[self.segment] + self.first * side.unit
        return _Index(first if peer is None else first + peer * side.span, self.step * side.unit, self.rows)


def _deliveries(count: np.ndarray, src: _Side, dst: _Side, world_size: int) -> _Deliveries:
    """Who serves each row to each of its destinations: the destination itself if it holds a
    replica (no bytes move), else the source replicas in turn, row by row, the rows of each
    (replica set, destination) numbered in row order."""
    segment = np.repeat(np.arange(len(count)), dst.width)
    dest = dst.base[segment] + np.tile(np.arange(dst.width), len(count))
    base, width = src.base[segment], src.width
    if width == 1:  # one replica: it serves every row
        return _Deliveries(segment, base, dest, np.zeros_like(dest), np.ones_like(dest), count[segment])
    holds = (dest >= base) & (dest < base + width)
    nth = _offset_within(base * world_size + dest, count[segment])
    replica = np.tile(np.arange(width), len(segment))
    segment, base, dest, nth, holds = (np.repeat(a, width) for a in (segment, base, dest, nth, holds))
    source = base + replica
    first = np.where(holds, 0, (replica - nth - dest) % width)
    step = np.where(holds, 1, width)
    rows = np.where(holds & (source != dest), 0, np.maximum(-(-(count[segment] - first) // step), 0))
    return _Deliveries(segment, source, dest, first, step, rows).take(rows > 0)


def _side_of(d: _Deliveries, peer: np.ndarray, value: _Side, key: _Side, world_size: int):
    """Deliveries to or from peers as rows per peer rank and the rows' `value` indices, ordered by
    peer, then by `key` index (the receiver's order: one that fills a slot range takes the rows in
    place)."""
    counts = np.bincount(peer, weights=d.rows, minlength=world_size).astype(np.int64)
    order = np.argsort(d.index(key, peer).first, kind="stable")
    d, peer = d.take(order), peer[order]
    keys = d.index(key, peer)
    # Rows need sorting only where two deliveries to one peer interleave.
    interleaved = (keys.first[1:] <= (keys.first + keys.step * (keys.rows - 1))[:-1]).any()
    return counts, replace(d.index(value), by=keys if interleaved else None)


def _messages(d: _Deliveries, src: _Side, dst: _Side) -> np.ndarray | None:
    """Every off-rank delivery of the edge as messages [source, dest, source index, destination
    index, rows]: per pair in destination order (the order of _side_of), adjacent ones merged where
    they continue at both ends. None where some rows are not contiguous at both ends (rows spread
    over replicas). Computed from the whole edge, so that every rank takes the same decision."""
    d = d.take(d.source != d.dest)
    if (d.step * src.unit != 1).any() or (d.step * dst.unit != 1).any():
        return None
    s, t = d.index(src).first, d.index(dst).first
    order = np.lexsort((t, d.dest, d.source))
    d, s, t = d.take(order), s[order], t[order]
    n = d.rows
    same = (d.source[1:] == d.source[:-1]) & (d.dest[1:] == d.dest[:-1])
    continues = same & (s[1:] == s[:-1] + n[:-1]) & (t[1:] == t[:-1] + n[:-1])
    head = np.flatnonzero(np.concatenate([[True], ~continues]))[: len(n)]
    rows = np.add.reduceat(n, head) if len(n) else n
    return np.stack([d.source[head], d.dest[head], s[head], t[head], rows], axis=1).astype(np.int64)


def _route(rank: int, world_size: int, segs: _Segments, src: _Side, dst: _Side) -> Routes:
    """`rank`'s side of one direction: rows it serves as a source and rows it takes as a destination."""
    d = _deliveries(segs.count, src, dst, world_size)
    sends, recvs = d.take(d.source == rank), d.take(d.dest == rank)
    send_counts, send_index = _side_of(sends, sends.dest, src, dst, world_size)
    recv_counts, recv_index = _side_of(recvs, recvs.source, dst, dst, world_size)
    messages = _messages(d, src, dst)
    if messages is None:
        return Routes(send_counts, recv_counts, send_index, recv_index)
    pairs = np.unique(messages[:, :2], axis=0, return_counts=True)[1]
    return Routes(send_counts, recv_counts, send_index, recv_index,
                  messages[messages[:, 0] == rank][:, [1, 2, 3, 4]], messages[messages[:, 1] == rank][:, [0, 2, 3, 4]],
                  int(pairs.max(initial=0)))


def _gather(segs: _Segments, llm: ModuleLayout, rank: int) -> Gather | None:
    """The edge as all-gathers over the LLM's TP groups (the Gather of `rank`), or None. Decided
    from the whole edge, so that every rank decides alike: each row has one holder (no encoder
    TP or cp replicas), which consumes it (holders and consumers share the LLM TP group: no SP, no
    rows for other CP ranks or pipeline stages), every member of a group holds as many rows as
    the others, and a group's slots take its rows member after member, each member's in its order."""
    holder, group, width = segs.encoder.base, segs.llm.base, segs.llm.width
    if segs.encoder.width != 1 or width < 2 or not ((group <= holder) & (holder < group + width)).all():
        return None
    coords = llm.coords(rank)
    if coords is None or coords["pp"] != 0:
        return None  # no LLM rows here (and, the edge being a gather, no encoder rows)
    members = group[:, None] + np.arange(width)  # each segment's group, as ranks
    held = np.bincount(holder, weights=segs.count, minlength=int(members.max(initial=0)) + 1)[members]
    order = np.lexsort((segs.encoder.index, holder))  # member after member, each in row order
    slot, count, same = segs.llm.index[order], segs.count[order], group[order][1:] == group[order][:-1]
    if (held != held[:, :1]).any() or (same & (slot[1:] < slot[:-1] + count[:-1])).any():
        return None
    first = llm.rank_of(cp=coords["cp"], dp=coords["dp"])
    mine = np.flatnonzero(group == first)
    return Gather(tuple(range(first, first + width)), int(held[mine[0], 0]) if len(mine) else 0)


def plan_edge(
    batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout, rank: int, world_size: int
) -> RankPlan:
    """`rank`'s forward and backward routes for one edge and one batch (or microbatch)."""
    _check_batch(batch, encoder, llm)
    segs = _Segments(batch, encoder, llm)
    forward = _route(rank, world_size, segs, segs.encoder, segs.llm)
    backward = _route(rank, world_size, segs, segs.llm, segs.encoder_grads)
    enc_coords, llm_coords = encoder.coords(rank), llm.coords(rank)
    num_source_rows = 0
    if enc_coords and enc_coords["pp"] == encoder.pp - 1:
        group = enc_coords["dp"] if encoder.cp_replicated else enc_coords["dp"] * encoder.cp + enc_coords["cp"]
        num_source_rows = int(segs.count[segs.enc_group == group].sum())
    num_dest_slots = 0
    if llm_coords and llm_coords["pp"] == 0:
        seq_local = batch.seq_len // llm.cp // (llm.tp if llm.sp else 1)
        num_dest_slots = seq_local * (batch.num_samples // llm.dp)
    gather = _gather(segs, llm, rank)
    # A gather's adjoint is each member's own rows' slice of its gradients: routes that stay here.
    assert gather is None or backward.recv_counts.sum() == backward.recv_counts[rank], "gather edge routes off rank"
    return RankPlan(rank, forward, backward, num_source_rows, num_dest_slots, encoder.cp_replicated, gather=gather)


class PlanCache:
    """Plans by batch metadata: with fixed image sizes every step reuses one plan, and with it the
    index tensors its execution uploads once."""

    def __init__(self, capacity: int = 16):
        self.capacity = capacity
        self._plans: dict = {}

    def plan(self, batch: BoundaryBatch, encoder: ModuleLayout, llm: ModuleLayout, rank: int,
             world_size: int) -> RankPlan:
        key = (batch.key, encoder, llm, rank, world_size)
        if key not in self._plans:
            if len(self._plans) >= self.capacity:
                self._plans.pop(next(iter(self._plans)))  # oldest first
            self._plans[key] = plan_edge(batch, encoder, llm, rank, world_size)
        return self._plans[key]


# ---- agreement of the metadata across ranks (agreement.check_agreement gathers these) -------------


def metadata_digest(batches: dict[str, BoundaryBatch]) -> int:
    """A 56-bit digest of every edge's metadata (edge name -> batch): fits an int64, negated too."""
    digest = hashlib.blake2b(digest_size=7)
    for name in sorted(batches):
        digest.update(name.encode() + b"\0" + batches[name].key)
    return int.from_bytes(digest.digest(), "little")


def _runs_text(positions: np.ndarray, most: int = 3) -> str:
    """A sample's positions as runs, e.g. '1-729, 731-1459' (the first `most`)."""
    starts = np.flatnonzero(np.diff(positions, prepend=positions[0] - 2) != 1)
    ends = np.append(starts[1:], len(positions)) - 1
    runs = [f"{positions[a]}" if a == b else f"{positions[a]}-{positions[b]}" for a, b in zip(starts, ends)]
    return ", ".join(runs[:most] + (["..."] if len(runs) > most else []))


def metadata_summary(batches: dict[str, BoundaryBatch]) -> tuple:
    """Per edge: (seq_len, per sample (rows, its positions as text, digest of its positions), the
    items' rows and DP ranks), to say where two ranks differ. One pass over the rows: only run once
    they do."""
    def sample(positions):
        text = _runs_text(positions) if len(positions) else ""
        return len(positions), text, hashlib.blake2b(positions.tobytes(), digest_size=8).digest()

    summary = []
    for name in sorted(batches):
        batch = batches[name]
        bounds = np.cumsum(batch.rows_per_sample)
        items = (tuple(batch.item_rows.tolist()), None if batch.item_dp is None else tuple(batch.item_dp.tolist()))
        summary.append((name, (batch.seq_len, tuple(map(sample, np.split(batch.positions, bounds[:-1]))), items)))
    return tuple(summary)


def _sample_text(sample) -> str:
    if sample is None:
        return "no such sample"
    rows, text, _ = sample
    return f"{rows} row{'s' * (rows > 1)} at positions {text}" if rows else "no rows"


def disagreement(summaries: list, ranks: list[int]) -> str:
    """One line naming two ranks whose metadata_summary differ (the first rank that holds the most
    common one and the first that does not) and the first edge and sample where they do."""
    common = Counter(summaries).most_common(1)[0][0]
    a = summaries.index(common)
    b = next(i for i, s in enumerate(summaries) if s != common)
    mine, theirs = dict(summaries[a]), dict(summaries[b])
    fix = "every rank must build the same rows_per_sample and positions"
    for edge in sorted(mine.keys() | theirs.keys()):
        x, y = mine.get(edge), theirs.get(edge)
        where = f"ranks {ranks[a]} and {ranks[b]} hold different boundary metadata for edge {edge}"
        if x is None or y is None:
            return f"{where}: only rank {ranks[b] if x is None else ranks[a]} has the edge; {fix}"
        if x[0] != y[0]:
            return f"{where}: seq_len {x[0]} on rank {ranks[a]}, {y[0]} on rank {ranks[b]}; {fix}"
        if x == y:
            continue
        if x[1] == y[1]:
            return (f"{where}: the same rows, split into different items or assigned to different encoder "
                    f"DP ranks; every rank must assign items the same way (boundary.assign_items)")
        s, (p, q) = next((i, pq) for i, pq in enumerate(zip_longest(x[1], y[1])) if pq[0] != pq[1])
        inside = " (alike in their first runs, not after)" if _sample_text(p) == _sample_text(q) else ""
        return (f"{where}, first at sample {s} of the batch: rank {ranks[a]} has {_sample_text(p)}, "
                f"rank {ranks[b]} has {_sample_text(q)}{inside}; {fix}")
    raise AssertionError("the summaries differ in nothing")
