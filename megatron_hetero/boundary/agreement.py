"""Every rank plans from the same metadata: `check_agreement`, before a batch's exchanges, stops
every rank with one line if the ranks hold different metadata for it (their plans would not pair up)."""

import torch
import torch.distributed as dist

from megatron_hetero.boundary.plan import (
    BoundaryBatch,
    BoundaryMismatch,
    disagreement,
    metadata_digest,
    metadata_summary,
)
from megatron_hetero.boundary.transfer import annotate


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
