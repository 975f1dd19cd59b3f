"""Colocated boundary: `boundary_exchange` is an autograd function: forward re-lays rows into the
LLM side's rows, backward routes their gradients back to the encoder rows. Where every LLM TP rank
takes all the rows its group holds, equal blocks in rank order (plan.Gather: encoder DP -> LLM TP
without SP), the forward is one all-gather on the LLM's TP group instead: one collective call costs
less than a batch of point-to-point ones (docs/runs/benchmarks.md, the boundary against upstream). `split_sends` /
`split_recvs`: the two sides of a rank apart in time, for the ordered schedules."""

import torch
import torch.distributed as dist

from megatron_hetero.boundary.plan import Gather, RankPlan
from megatron_hetero.boundary.transfer import Transfer, annotate, complete, make_transfer, moves_for


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
            moves = moves_for(plan, "forward", rows.device)
            return complete([make_transfer(rows.detach(), moves, rows, True, group)])[0]

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
        moves = moves_for(plan, "backward", grad_slots.device)
        return complete([make_transfer(grad_slots.detach().contiguous(), moves, grad_slots, True, group)])[0]


def split_sends(source: torch.Tensor, plan: RankPlan, direction: str, group=None) -> Transfer:
    """Colocated, as a schedule that runs the two sides of the boundary at different times posts
    it: this rank's rows ("forward") or its LLM side's row gradients ("backward") for the other
    ranks. The part it routes to itself is delivered by `split_recvs`."""
    moves = moves_for(plan, direction, source.device)
    return make_transfer(source.detach().contiguous(), moves, source, False, group)


def split_recvs(plan: RankPlan, direction: str, like: torch.Tensor, own: torch.Tensor | None,
                group=None) -> Transfer:
    """The receiving side of `split_sends`: the LLM side's rows ("forward", `like` a boundary row)
    or the encoder's row gradients ("backward", `like` its rows); `own` is this rank's side of the
    same microbatch (its rows, or its LLM side's row gradients), whose part routed to itself is
    copied in; None where the rank routes nothing to itself."""
    moves = moves_for(plan, direction, like.device)
    assert own is not None or not len(moves.local_src), "rows routed to this rank need its own side"
    source = None if own is None else own.detach()
    return make_transfer(source, moves, like, True, group, send=False)
