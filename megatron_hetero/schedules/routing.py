"""Rows across the boundary without a backward (evaluation), for either placement."""

import torch

from megatron_hetero.boundary import RankPlan, boundary_exchange
from megatron_hetero.boundary.exchange import recv_forward, send_forward


def route_rows(rows: torch.Tensor, plan: RankPlan, colocated: bool) -> torch.Tensor | None:
    """This rank's LLM input slots (None off the LLM)."""
    if colocated:
        return boundary_exchange(rows, plan)
    sent = send_forward(rows, plan) if plan.num_source_rows else None
    slots = recv_forward(plan, rows).wait() if plan.num_dest_slots else None
    if sent is not None:
        sent.wait()
    return slots
