"""Boundary execution: one all-to-all each way, driven by a RankPlan (see plan.py)."""

import numpy as np
import torch
import torch.distributed as dist

from megatron_hetero.boundary.plan import RankPlan, Routes


def _exchange(
    source: torch.Tensor, routes: Routes, num_dest: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Gather source rows at send_index, all-to-all them, write them at recv_index of a zeroed
    [num_dest, hidden] tensor. Each destination slot receives at most once: writes, not sums."""
    hidden = source.shape[-1]
    send_index = torch.as_tensor(routes.send_index, device=source.device)
    recv_index = torch.as_tensor(routes.recv_index, device=source.device)
    send = source.index_select(0, send_index)
    recv = source.new_empty(len(routes.recv_index), hidden)
    dist.all_to_all_single(
        recv,
        send,
        output_split_sizes=routes.recv_counts.tolist(),
        input_split_sizes=routes.send_counts.tolist(),
        group=group,
    )
    dest = source.new_zeros(num_dest, hidden)
    dest.index_copy_(0, recv_index, recv)
    return dest


class BoundaryExchange(torch.autograd.Function):
    """forward: encoder rows [num_source_rows, h] -> LLM input slots [num_dest_slots, h], every row
    written at each consuming rank's slot, zeros elsewhere.
    backward: slot gradients -> row gradients, each encoder replica receiving every row's gradient
    once, from one LLM replica."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: RankPlan, group: dist.ProcessGroup | None):
        ctx.plan, ctx.group = plan, group
        return _exchange(rows, plan.forward, plan.num_dest_slots, group)

    @staticmethod
    def backward(ctx, grad_slots: torch.Tensor):
        grad_rows = _exchange(
            grad_slots.contiguous(), ctx.plan.backward, ctx.plan.num_source_rows, ctx.group
        )
        return grad_rows, None, None


def boundary_exchange(
    rows: torch.Tensor, plan: RankPlan, group: dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Differentiable re-layout of encoder rows into this rank's LLM input slots."""
    return BoundaryExchange.apply(rows, plan, group)


def slot_mask(plan: RankPlan, device: torch.device | str) -> torch.Tensor:
    """[num_dest_slots] bool: the slots that this rank's LLM input takes from the boundary."""
    mask = torch.zeros(plan.num_dest_slots, dtype=torch.bool, device=device)
    mask[torch.as_tensor(np.asarray(plan.forward.recv_index), device=device)] = True
    return mask


# ---- non-colocated: point-to-point, one call per side and microbatch --------------------------


class PendingRows:
    """A started receive: wait() completes it and returns the [num_dest, hidden] tensor."""

    def __init__(self, works, chunks, recv_index, num_dest, hidden, like):
        self._works, self._chunks = works, chunks
        self._recv_index, self._num_dest, self._hidden, self._like = recv_index, num_dest, hidden, like

    def wait(self) -> torch.Tensor:
        for work in self._works:
            work.wait()
        dest = self._like.new_zeros(self._num_dest, self._hidden)
        if self._chunks:
            dest.index_copy_(0, self._recv_index, torch.cat(self._chunks))
        return dest


def _peers(counts: np.ndarray):
    """(peer, start, count) for every peer with rows, in rank order (the plan's order)."""
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return [(int(p), int(starts[p]), int(counts[p])) for p in np.flatnonzero(counts)]


def start_send(source: torch.Tensor, routes: Routes, group=None) -> list:
    """isend this rank's rows of `routes` (peers are global ranks); returns the works."""
    send = source.index_select(0, torch.as_tensor(routes.send_index, device=source.device))
    ops = [dist.P2POp(dist.isend, send[start : start + n], peer, group)
           for peer, start, n in _peers(routes.send_counts)]
    return dist.batch_isend_irecv(ops) if ops else []


def start_recv(routes: Routes, num_dest: int, like: torch.Tensor, group=None) -> PendingRows:
    """irecv this rank's rows of `routes` into a zeroed [num_dest, hidden] tensor like `like`."""
    hidden = like.shape[-1]
    chunks = [like.new_empty(n, hidden) for _, _, n in _peers(routes.recv_counts)]
    ops = [dist.P2POp(dist.irecv, chunk, peer, group)
           for (peer, _, _), chunk in zip(_peers(routes.recv_counts), chunks)]
    works = dist.batch_isend_irecv(ops) if ops else []
    recv_index = torch.as_tensor(routes.recv_index, device=like.device)
    return PendingRows(works, chunks, recv_index, num_dest, hidden, like)


def send_forward(rows: torch.Tensor, plan: RankPlan, group=None) -> list:
    """Encoder side: start sending this microbatch's rows to the LLM ranks that consume them."""
    return start_send(rows.detach(), plan.forward, group)


def recv_forward(plan: RankPlan, like: torch.Tensor, group=None) -> PendingRows:
    """LLM side: start receiving this microbatch's rows into its input slots."""
    return start_recv(plan.forward, plan.num_dest_slots, like, group)


def send_backward(grad_slots: torch.Tensor, plan: RankPlan, group=None) -> list:
    """LLM side: start returning the slot gradients of this microbatch (one replica per row)."""
    return start_send(grad_slots.detach(), plan.backward, group)


def recv_backward(plan: RankPlan, like: torch.Tensor, group=None) -> PendingRows:
    """Encoder side: start receiving every row's gradient for this microbatch."""
    return start_recv(plan.backward, plan.num_source_rows, like, group)
