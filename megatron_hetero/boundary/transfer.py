"""The shared core of the boundary's transports, driven by a RankPlan (see plan.py).

Rows a rank routes to itself are copied directly; the others move by point-to-point sends and
receives with exactly the peers that have rows, grouped into one batch per direction (what NCCL's
all-to-all does internally, without the self copy and without idle peers). Gloo and NCCL alike. Where
the plan's rows are contiguous at both ends (every layout whose rows are not spread over replicas)
they go as messages from the source rows straight into the destination slots, one per run of
rows; otherwise through a gathered send buffer and a scattered receive buffer.

The transports: colocated.py (autograd, and split sides for the ordered schedules),
non_colocated.py (one side per microbatch); rows.py writes the LLM side's rows into its input.
A `Transfer` is one side, not yet posted: a schedule posts several in one batch (`post`) and waits
on them; `complete` posts, waits and returns their results.
"""

from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.profiler import record_function

from megatron_hetero.boundary.plan import RankPlan, Routes

# Prefix of the torch.profiler ranges that mark the boundary's work (a profile's own table of
# them: benchmarks/bench.py profile_step).
ANNOTATION = "hetero::"


def annotate(name: str):
    """The profiler range ANNOTATION + name while a profiler runs, else nothing: an idle range
    still costs ~20 us of host time, a third of a small boundary exchange's (docs/runs/benchmarks.md)."""
    return record_function(ANNOTATION + name) if torch.autograd._profiler_enabled() else nullcontext()


@dataclass
class Moves:
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
# benchmarks/gpu_speed_run.sh times transfers of a few messages per pair).
MAX_PAIR_MESSAGES = 64


def _messages(routes: Routes, sends: np.ndarray | None, recvs: np.ndarray | None) -> tuple[list | None, list | None]:
    """(sends, receives) as (peer, start, count): starts in the source (sends) and the destination
    (receives). Every rank of the edge takes the same decision (pair_messages is the edge's)."""
    if sends is None or routes.pair_messages > MAX_PAIR_MESSAGES:
        return None, None
    return ([(int(p), int(s), int(n)) for p, s, _, n in sends], [(int(p), int(t), int(n)) for p, _, t, n in recvs])


def _moves(routes: Routes, rank: int, num_dest: int, device, filled: np.ndarray | None = None,
           filled_side: str = "", partial: bool = False) -> Moves:
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
    return Moves(
        on(local_src), on(local_dst), on(send_index), send_peers, on(recv_index), recv_peers,
        num_dest, _as_range(send_index), _as_range(recv_index), _as_range(local_src),
        _as_range(local_dst), send_messages=send_messages, recv_messages=recv_messages,
        zero_fill=written < num_dest,
    )


def filled_index(plan: RankPlan) -> np.ndarray:
    """The slots of this rank's LLM input that the boundary fills, in order (each filled once)."""
    if "filled" not in plan.cache:
        plan.cache["filled"] = np.sort(plan.forward.recv_index)
    return plan.cache["filled"]


def moves_for(plan: RankPlan, direction: str, device) -> Moves:
    """The plan's moves for `direction` ("forward"/"backward") on `device`, cached on the plan:
    a plan reused over steps (fixed image sizes) pays its index uploads once. The LLM side
    addresses its rows (the filled slots), not its whole input."""
    key = (direction, str(device))
    if key not in plan.cache:
        filled = filled_index(plan)
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


def make_transfer(source, moves: Moves, like: torch.Tensor, receive: bool, group, send: bool = True) -> Transfer:
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
