"""Non-colocated boundary: `forward_sends / forward_recvs / backward_sends / backward_recvs` build
one side's transfer of one microbatch, not yet posted: a pipeline schedule posts several in one
batch (transfer.post) and waits on them."""

import torch

from megatron_hetero.boundary.plan import RankPlan
from megatron_hetero.boundary.transfer import Moves, Transfer, make_transfer, moves_for


def _disjoint_moves(plan: RankPlan, direction: str, device) -> Moves:
    moves = moves_for(plan, direction, device)
    assert not len(moves.local_src), "the point-to-point calls are for disjoint ranks; colocated " \
        "modules use boundary_exchange"
    return moves


def forward_sends(rows: torch.Tensor, plan: RankPlan, group=None) -> Transfer:
    """Encoder side: this microbatch's rows for the LLM ranks that consume them."""
    return make_transfer(rows.detach(), _disjoint_moves(plan, "forward", rows.device), rows, False, group)


def forward_recvs(plan: RankPlan, like: torch.Tensor, group=None) -> Transfer:
    """LLM side: this microbatch's rows; the result is the rows of its filled slots, in order."""
    return make_transfer(None, _disjoint_moves(plan, "forward", like.device), like, True, group)


def backward_sends(grad_slots: torch.Tensor, plan: RankPlan, group=None) -> Transfer:
    """LLM side: this microbatch's gradients of its boundary rows (one replica per row)."""
    moves = _disjoint_moves(plan, "backward", grad_slots.device)
    return make_transfer(grad_slots.detach(), moves, grad_slots, False, group)


def backward_recvs(plan: RankPlan, like: torch.Tensor, group=None) -> Transfer:
    """Encoder side: every row's gradient; the result is the row gradients."""
    return make_transfer(None, _disjoint_moves(plan, "backward", like.device), like, True, group)
