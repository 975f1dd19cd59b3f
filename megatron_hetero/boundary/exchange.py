"""Boundary execution, driven by a RankPlan (see plan.py).

Rows a rank routes to itself are copied directly; the others move by point-to-point sends and
receives with exactly the peers that have rows, grouped into one batch per direction (what NCCL's
all-to-all does internally, without the self copy and without idle peers). Gloo and NCCL alike. Where
the plan's rows are contiguous at both ends (every layout whose rows are not spread over replicas)
they go as messages from the source rows straight into the destination slots, one per run of
rows; otherwise through a gathered send buffer and a scattered receive buffer.

The LLM side holds only the rows its input takes from the boundary, in slot order (`filled_slots`
names their slots): no zero-filled slot tensor; the LLM writes them into its input embedding
(`input_rows`, `write_rows`) with one row copy and reads their gradients back with one gather.

- colocated: `boundary_exchange` is an autograd function: forward re-lays rows into the LLM
  side's rows, backward routes their gradients back to the encoder rows. Where every LLM TP rank
  takes all the rows its group holds, equal blocks in rank order (plan.Gather: encoder DP -> LLM
  TP without SP), the forward is one all-gather on the LLM's TP group instead: one collective
  call costs less than a batch of point-to-point ones (docs/benchmarks.md, item 3);
- non-colocated: `forward_sends / forward_recvs / backward_sends / backward_recvs` build one side's
  transfer of one microbatch, not yet posted: a pipeline schedule posts several in one batch
  (`post`) and waits on them; `complete` posts, waits and returns their results;
- both: `check_agreement`, before a batch's exchanges, stops every rank with one line if the ranks
  hold different metadata for it (their plans would not pair up).
"""

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_hetero.boundary.plan import (
    BoundaryBatch,
    BoundaryMismatch,
    Gather,
    RankPlan,
    Routes,
    disagreement,
    metadata_digest,
    metadata_summary,
)

# Prefix of the torch.profiler ranges that mark the boundary's work (a profile's own table of
# them: training/bench.profile_step).
ANNOTATION = "hetero::"


def annotate(name: str):
    """The profiler range ANNOTATION + name while a profiler runs, else nothing: an idle range
    still costs ~20 us of host time, a third of a small boundary exchange's (docs/benchmarks.md)."""
    return record_function(ANNOTATION + name) if torch.autograd._profiler_enabled() else nullcontext()


@dataclass
class _Moves:
    """One direction of one plan on one rank and device: index tensors, made once per plan."""

    local_src: torch.Tensor  # rows this rank delivers to itself: from here ...
    local_dst: torch.Tensor  # ... to here
    send_index: torch.Tensor  # rows for other ranks, peers in rank order
    send_peers: list  # (peer, start, count) into send_index
    recv_index: torch.Tensor  # where rows from other ranks land, peers in rank order
    recv_peers: list  # (peer, start, count) into recv_index
    num_dest: int
    # Zero-copy cases: remote rows to send / to receive form one contiguous range (start, stop).
    send_range: tuple | None
    recv_range: tuple | None
    local_src_range: tuple | None
    local_dst_range: tuple | None
    # Remote rows as point-to-point messages straight from the source rows into the destination,
    # (peer, start, count) each: no gather before sending, no scatter after receiving (plan.py's
    # Routes.send_messages / recv_messages); None: the gather / scatter above.
    send_messages: list | None = None
    recv_messages: list | None = None
    # Some destination rows receive nothing and are zeros (RankPlan.partial_gradients).
    zero_fill: bool = False


def _as_range(index: np.ndarray) -> tuple | None:
    if len(index) and index[-1] - index[0] == len(index) - 1 and np.all(np.diff(index) == 1):
        return int(index[0]), int(index[-1]) + 1
    return None


def _segments(counts: np.ndarray):
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [(int(p), int(starts[p]), int(counts[p])) for p in np.flatnonzero(counts)]


# Most messages between two ranks in one transfer before rows go through one gathered buffer per
# peer instead (each message is its own point-to-point op; a guess, not measured yet:
# tools/gpu_speed_run.sh times transfers of a few messages per pair).
MAX_PAIR_MESSAGES = 64


def _messages(routes: Routes, sends: np.ndarray | None, recvs: np.ndarray | None) -> tuple[list | None, list | None]:
    """(sends, receives) as (peer, start, count): starts in the source (sends) and the destination
    (receives). Every rank of the edge takes the same decision (pair_messages is the edge's)."""
    if sends is None or routes.pair_messages > MAX_PAIR_MESSAGES:
        return None, None
    return ([(int(p), int(s), int(n)) for p, s, _, n in sends], [(int(p), int(t), int(n)) for p, _, t, n in recvs])


def _moves(routes: Routes, rank: int, num_dest: int, device, filled: np.ndarray | None = None,
           filled_side: str = "", partial: bool = False) -> _Moves:
    """`filled` (with `filled_side` "send" or "recv"): the LLM's filled slots; that side's slot
    indices become positions among them (the LLM side's rows). `partial`: destination rows may
    receive nothing (zeros)."""
    send_index, recv_index = routes.send_index, routes.recv_index
    send_messages, recv_messages = routes.send_messages, routes.recv_messages
    if filled_side == "recv":
        recv_index = np.searchsorted(filled, recv_index)
        if recv_messages is not None:
            recv_messages = recv_messages.copy()
            recv_messages[:, 2] = np.searchsorted(filled, recv_messages[:, 2])
    elif filled_side == "send":
        send_index = np.searchsorted(filled, send_index)
        if send_messages is not None:
            send_messages = send_messages.copy()
            send_messages[:, 1] = np.searchsorted(filled, send_messages[:, 1])
    sends, recvs = _segments(routes.send_counts), _segments(routes.recv_counts)
    send_self = [(s, n) for p, s, n in sends if p == rank]
    recv_self = [(s, n) for p, s, n in recvs if p == rank]
    assert len(send_self) == len(recv_self) and all(a[1] == b[1] for a, b in zip(send_self, recv_self))

    def pick(index, segments):
        return np.concatenate([np.empty(0, np.int64)] + [index[s : s + n] for s, n in segments])

    def remote(index, segments):
        others = [(p, s, n) for p, s, n in segments if p != rank]
        starts = np.concatenate([[0], np.cumsum([n for _, _, n in others])[:-1]]).astype(int)
        return pick(index, [(s, n) for _, s, n in others]), [
            (p, int(start), n) for (p, _, n), start in zip(others, starts)]

    local_src, local_dst = pick(send_index, send_self), pick(recv_index, recv_self)
    send_index, send_peers = remote(send_index, sends)
    recv_index, recv_peers = remote(recv_index, recvs)
    on = lambda index: torch.as_tensor(index, device=device)  # noqa: E731
    send_messages, recv_messages = _messages(routes, send_messages, recv_messages)
    # Every destination row is written once (the LLM side holds only its filled slots; every
    # encoder row gets its gradient, from one LLM replica): destinations need no zero fill, but
    # where an encoder's cp replicas share its rows' gradients.
    written = len(recv_index) + len(local_dst)
    assert written == num_dest or (partial and written < num_dest), (len(recv_index), len(local_dst), num_dest)
    return _Moves(
        on(local_src), on(local_dst), on(send_index), send_peers, on(recv_index), recv_peers,
        num_dest, _as_range(send_index), _as_range(recv_index), _as_range(local_src),
        _as_range(local_dst), send_messages=send_messages, recv_messages=recv_messages,
        zero_fill=written < num_dest,
    )


def _filled(plan: RankPlan) -> np.ndarray:
    """The slots of this rank's LLM input that the boundary fills, in order (each filled once)."""
    if "filled" not in plan.cache:
        plan.cache["filled"] = np.sort(plan.forward.recv_index)
    return plan.cache["filled"]


def _moves_for(plan: RankPlan, direction: str, device) -> _Moves:
    """The plan's moves for `direction` ("forward"/"backward") on `device`, cached on the plan:
    a plan reused over steps (fixed image sizes) pays its index uploads once. The LLM side
    addresses its rows (the filled slots), not its whole input."""
    key = (direction, str(device))
    if key not in plan.cache:
        filled = _filled(plan)
        if direction == "forward":
            plan.cache[key] = _moves(plan.forward, plan.rank, len(filled), device, filled, "recv")
        else:
            plan.cache[key] = _moves(plan.backward, plan.rank, plan.num_source_rows, device, filled, "send",
                                     partial=plan.partial_gradients)
    return plan.cache[key]


class Transfer:
    """One side of one transfer, not yet posted: its point-to-point ops, the self-copy to run once
    they are posted, and where the received rows land. Schedules post several transfers in one
    batch (`post`), so that both ends of a link see their sends and receives grouped alike."""

    def __init__(self, ops, dest=None, scatter=None, local=None):
        self.ops = ops
        self.dest = dest  # the destination, complete once the ops have completed
        self._scatter = scatter  # (index, buffer): rows received out of place, to land at dest[index]
        self._local = local  # dest -> dest, copying the rows this rank delivers to itself

    def copy_local(self) -> None:
        if self._local is not None:
            self.dest = self._local(self.dest)

    def result(self) -> torch.Tensor | None:
        """The destination (None on a side that only sends); call once the ops have completed."""
        if self._scatter is not None:
            index, buffer = self._scatter
            self.dest.index_copy_(0, index, buffer)
            self._scatter = None
        return self.dest


def post(transfers) -> list:
    """Post every op of `transfers` in one batch per process group (torch batches one group's ops),
    then their self-copies; returns the works."""
    batches: dict = {}
    for op in (op for t in transfers for op in t.ops):
        batches.setdefault(op.group, []).append(op)
    works = [work for ops in batches.values() for work in dist.batch_isend_irecv(ops)]
    for t in transfers:
        t.copy_local()
    return works


def complete(transfers) -> list:
    """Post `transfers` in one batch, wait for them, and return their results."""
    for work in post(transfers):
        work.wait()
    return [t.result() for t in transfers]


def _rows(source: torch.Tensor, index: torch.Tensor, span: tuple | None) -> torch.Tensor:
    """source[index], as a view when the index is one contiguous range."""
    return source[span[0] : span[1]] if span else source.index_select(0, index)


def _transfer(source, moves: _Moves, like: torch.Tensor, receive: bool, group, send: bool = True) -> Transfer:
    """This rank's sends of `source` (None or not `send`: nothing to send) and, if `receive`, its
    receives into a destination; the local rows (of `source`) are copied once the transfers are
    posted, while they run. Where every destination row is a contiguous run of `source`, the
    destination is a view of it: callers read results, they never write into them."""
    hidden = like.shape[-1]
    ops, dest, scatter = [], None, None
    sending = send and source is not None
    if sending and moves.send_messages is not None:
        ops += [dist.P2POp(dist.isend, source[s : s + n], p, group) for p, s, n in moves.send_messages]
    elif sending and moves.send_peers:
        rows = _rows(source, moves.send_index, moves.send_range)
        ops += [dist.P2POp(dist.isend, rows[s : s + n], p, group) for p, s, n in moves.send_peers]
    local = source is not None and receive and len(moves.local_src) > 0
    whole = local and moves.local_dst_range == (0, moves.num_dest)
    if receive and not whole:
        dest = (like.new_zeros if moves.zero_fill else like.new_empty)(moves.num_dest, hidden)
        if moves.recv_messages is not None:
            ops += [dist.P2POp(dist.irecv, dest[t : t + n], p, group) for p, t, n in moves.recv_messages]
        else:
            if moves.recv_range:
                target = dest[moves.recv_range[0] : moves.recv_range[1]]
            else:
                target = like.new_empty(len(moves.recv_index), hidden)
                scatter = (moves.recv_index, target)
            ops += [dist.P2POp(dist.irecv, target[s : s + n], p, group) for p, s, n in moves.recv_peers]

    def copy_local(dest):
        rows = _rows(source, moves.local_src, moves.local_src_range)
        if whole:  # every row from this rank: the rows themselves (a view where contiguous), no copy
            return rows
        if moves.local_dst_range:
            dest[moves.local_dst_range[0] : moves.local_dst_range[1]] = rows
        else:
            dest.index_copy_(0, moves.local_dst, rows)
        return dest

    return Transfer(ops, dest, scatter, copy_local if local else None)


def _all_gather(rows: torch.Tensor, gather: Gather, group) -> torch.Tensor:
    """The LLM side's rows of a gather edge: every member's `gather.rows` rows, in rank order."""
    assert dist.get_process_group_ranks(group) == list(gather.ranks), "llm_tp_group is not the plan's group"
    dest = rows.new_empty(len(gather.ranks) * gather.rows, rows.shape[-1])
    if gather.rows:  # the same on every member
        dist.all_gather_into_tensor(dest, rows.contiguous(), group=group)  # torch >= 1.13; 2.11 on the GPUs
    return dest


def _own_rows(grad_rows: torch.Tensor, gather: Gather, rank: int) -> torch.Tensor:
    """A gather edge's backward on a member: the gradients of its own rows, a slice of the LLM
    side's (the all-gather's adjoint under the one-replica rule; its routes say the same)."""
    start = gather.ranks.index(rank) * gather.rows
    return grad_rows[start : start + gather.rows].contiguous()


class BoundaryExchange(torch.autograd.Function):
    """forward: encoder rows [num_source_rows, h] -> the LLM side's rows [filled slots, h], every
    row delivered to each rank that consumes it, in slot order: one all_gather_into_tensor over
    the LLM TP group where the plan is a gather (RankPlan.gather) and the group is given, else
    point-to-point messages.
    backward: their gradients -> row gradients, each encoder replica receiving every row's gradient
    once, from one LLM replica (for a gather, itself: the slice of its own rows, no message)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: RankPlan, group, llm_tp_group):
        ctx.plan, ctx.group = plan, group
        with annotate("boundary forward"):
            if plan.gather is not None and llm_tp_group is not None:
                return _all_gather(rows.detach(), plan.gather, llm_tp_group)
            moves = _moves_for(plan, "forward", rows.device)
            return complete([_transfer(rows.detach(), moves, rows, True, group)])[0]

    @staticmethod
    def backward(ctx, grad_slots: torch.Tensor):
        return exchange_gradients(grad_slots, ctx.plan, ctx.group), None, None, None


def boundary_exchange(rows: torch.Tensor, plan: RankPlan, group=None, llm_tp_group=None) -> torch.Tensor:
    """Colocated: differentiable re-layout of encoder rows into this rank's LLM side's rows (its
    filled slots, in order). `group` must span every rank of the edge's modules (peers are its
    ranks; None: the world). `llm_tp_group`: this rank's LLM tensor-parallel group; where the plan
    is a gather over it (RankPlan.gather) the rows move by one all-gather on it; None: point to
    point always (the same rows)."""
    return BoundaryExchange.apply(rows, plan, group, llm_tp_group)


def exchange_gradients(grad_slots: torch.Tensor, plan: RankPlan, group=None) -> torch.Tensor:
    """Colocated, outside autograd: the LLM side's row gradients [filled slots, h] -> encoder row
    gradients [num_source_rows, h] (boundary_exchange's backward; schedules that recompute the
    encoder call it once the LLM is done)."""
    with annotate("boundary backward"):
        if plan.gather is not None:
            assert plan.gather.rows == plan.num_source_rows, "a gather member holds its rows"
            return _own_rows(grad_slots.detach(), plan.gather, plan.rank)
        moves = _moves_for(plan, "backward", grad_slots.device)
        return complete([_transfer(grad_slots.detach().contiguous(), moves, grad_slots, True, group)])[0]


def filled_slots(plan: RankPlan, device) -> torch.Tensor:
    """[filled] int64: the slots (of this rank's LLM input [b_local * seq], sample-major) that its
    boundary rows fill, in their order (cached on the plan; do not modify)."""
    key = ("filled", str(device))
    if key not in plan.cache:
        plan.cache[key] = torch.as_tensor(_filled(plan), device=device)
    return plan.cache[key]


def input_rows(plan: RankPlan, b_local: int, device) -> torch.Tensor:
    """[filled] int64: where this rank's boundary rows go in its LLM input embedding, which is
    sequence-first [seq, b_local, h], as rows of its [seq * b_local, h] view (cached on the plan)."""
    key = ("input_rows", b_local, str(device))
    if key not in plan.cache:
        slots = _filled(plan)
        seq = plan.num_dest_slots // max(b_local, 1)
        plan.cache[key] = torch.as_tensor(slots % seq * b_local + slots // seq, device=device)
    return plan.cache[key]


class WriteRows(torch.autograd.Function):
    """forward: `rows` [n, h] written into `embedding` [s, b, h] in place (into a copy where it is
    a view), at rows `at` [n] of its [s * b, h] view (input_rows): one pass over the rows, none over
    the rest.
    backward: the rows' gradients gathered from there; the embedding's gradient with them zeroed
    (whole-row kernels: index_select, index_fill; autograd's own in-place write on a view would
    copy the whole embedding, and its 2-D advanced indexing runs per element)."""

    @staticmethod
    def forward(ctx, embedding: torch.Tensor, rows: torch.Tensor, at: torch.Tensor):
        # Autograd refuses an in-place write into a view made inside a custom Function, and the LLM's
        # embedding can be one: under TP without SP megatron-core's all-reduce returns its input, and
        # at micro batch 1 the embedding's [b, s, h] -> [s, b, h] transpose is contiguous already, so
        # its .contiguous() keeps the view. A view's rows go into a copy; anything else is written in place.
        if embedding._is_view():
            embedding = embedding.clone(memory_format=torch.contiguous_format)
        else:
            ctx.mark_dirty(embedding)
        ctx.save_for_backward(at)
        ctx.rows_dtype = rows.dtype
        embedding.view(-1, embedding.shape[-1]).index_copy_(0, at, rows.to(embedding.dtype))
        return embedding

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (at,) = ctx.saved_tensors
        flat = grad.reshape(-1, grad.shape[-1])
        grad_rows = flat.index_select(0, at).to(ctx.rows_dtype)
        return flat.index_fill(0, at, 0).view_as(grad), grad_rows, None


def write_rows(embedding: torch.Tensor, rows: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
    """The LLM's input embedding [s, b, h] (contiguous) with this rank's boundary `rows` in place
    of the text at `at` (input_rows); differentiable in both. Use the result: where `embedding` is a
    view it is left as it was."""
    return WriteRows.apply(embedding, rows, at)


# ---- non-colocated: one transfer per side and microbatch, posted by the caller ------------------


def _disjoint_moves(plan: RankPlan, direction: str, device) -> _Moves:
    moves = _moves_for(plan, direction, device)
    assert not len(moves.local_src), "the point-to-point calls are for disjoint ranks; colocated " \
        "modules use boundary_exchange"
    return moves


def forward_sends(rows: torch.Tensor, plan: RankPlan, group=None) -> Transfer:
    """Encoder side: this microbatch's rows for the LLM ranks that consume them."""
    return _transfer(rows.detach(), _disjoint_moves(plan, "forward", rows.device), rows, False, group)


def forward_recvs(plan: RankPlan, like: torch.Tensor, group=None) -> Transfer:
    """LLM side: this microbatch's rows; the result is the rows of its filled slots, in order."""
    return _transfer(None, _disjoint_moves(plan, "forward", like.device), like, True, group)


def backward_sends(grad_slots: torch.Tensor, plan: RankPlan, group=None) -> Transfer:
    """LLM side: this microbatch's gradients of its boundary rows (one replica per row)."""
    moves = _disjoint_moves(plan, "backward", grad_slots.device)
    return _transfer(grad_slots.detach(), moves, grad_slots, False, group)


def backward_recvs(plan: RankPlan, like: torch.Tensor, group=None) -> Transfer:
    """Encoder side: every row's gradient; the result is the row gradients."""
    return _transfer(None, _disjoint_moves(plan, "backward", like.device), like, True, group)


# ---- colocated, split: the sending and the receiving side of a rank apart in time -------------


def split_sends(source: torch.Tensor, plan: RankPlan, direction: str, group=None) -> Transfer:
    """Colocated, as a schedule that runs the two sides of the boundary at different times posts
    it: this rank's rows ("forward") or its LLM side's row gradients ("backward") for the other
    ranks. The part it routes to itself is delivered by `split_recvs`."""
    moves = _moves_for(plan, direction, source.device)
    return _transfer(source.detach().contiguous(), moves, source, False, group)


def split_recvs(plan: RankPlan, direction: str, like: torch.Tensor, own: torch.Tensor | None,
                group=None) -> Transfer:
    """The receiving side of `split_sends`: the LLM side's rows ("forward", `like` a boundary row)
    or the encoder's row gradients ("backward", `like` its rows); `own` is this rank's side of the
    same microbatch (its rows, or its LLM side's row gradients), whose part routed to itself is
    copied in; None where the rank routes nothing to itself."""
    moves = _moves_for(plan, direction, like.device)
    assert own is not None or not len(moves.local_src), "rows routed to this rank need its own side"
    source = None if own is None else own.detach()
    return _transfer(source, moves, like, True, group, send=False)


# ---- every rank plans from the same metadata ----------------------------------------------------


def check_agreement(batches: dict[str, BoundaryBatch], device, group=None) -> None:
    """Raise BoundaryMismatch on every rank of `group` (None: the world) unless all of them hold
    the same metadata for `batches` (edge name -> batch): plans from different metadata do not pair
    up, and the exchange would hang or put rows in the wrong slots. Call it before the exchanges,
    at the same point on every rank. Cost: one all_reduce of two int64, (max, -min) of a digest.
    Only when they differ, which every rank then sees, do the ranks gather per-sample summaries to
    name two ranks and the first sample where they differ."""
    with annotate("check_agreement"):
        _agree(batches, device, group)


def _agree(batches: dict[str, BoundaryBatch], device, group) -> None:
    digest = metadata_digest(batches)
    extremes = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    highest, minus_lowest = extremes.tolist()
    if highest == -minus_lowest:
        return
    summaries = [None] * dist.get_world_size(group)
    dist.all_gather_object(summaries, metadata_summary(batches), group=group)
    raise BoundaryMismatch(disagreement(summaries, dist.get_process_group_ranks(group or dist.group.WORLD)))
