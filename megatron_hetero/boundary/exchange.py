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
