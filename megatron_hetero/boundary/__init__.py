"""Boundary communicators: a pure routing plan (plan.py) and its execution: transfer.py (the shared
core), colocated.py and non_colocated.py (one module per transport), rows.py (the LLM side's rows),
agreement.py (every rank plans from the same metadata)."""

from megatron_hetero.boundary.agreement import check_agreement
from megatron_hetero.boundary.balance import assign_items
from megatron_hetero.boundary.colocated import boundary_exchange
from megatron_hetero.boundary.plan import (
    BoundaryBatch,
    BoundaryError,
    BoundaryMismatch,
    PlanCache,
    RankPlan,
    check_edge_layouts,
    plan_edge,
)
from megatron_hetero.boundary.rows import filled_slots, input_rows, write_rows

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
