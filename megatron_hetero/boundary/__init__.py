"""Boundary communicators: a pure routing plan (plan.py) and its execution (exchange.py)."""

from megatron_hetero.boundary.balance import assign_items
from megatron_hetero.boundary.exchange import boundary_exchange, check_agreement, filled_slots, input_rows, write_rows
from megatron_hetero.boundary.plan import (
    BoundaryBatch,
    BoundaryError,
    BoundaryMismatch,
    PlanCache,
    RankPlan,
    check_edge_layouts,
    plan_edge,
)

__all__ = [
    "BoundaryBatch",
    "BoundaryError",
    "BoundaryMismatch",
    "PlanCache",
    "RankPlan",
    "assign_items",
    "boundary_exchange",
    "check_agreement",
    "check_edge_layouts",
    "filled_slots",
    "input_rows",
    "plan_edge",
    "write_rows",
]
