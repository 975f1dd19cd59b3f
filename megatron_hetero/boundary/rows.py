"""The LLM side of the boundary: it holds only the rows its input takes from the boundary, in slot
order (`filled_slots` names their slots), no zero-filled slot tensor; the LLM writes them into its
input embedding (`input_rows`, `write_rows`) with one row copy and reads their gradients back with
one gather."""

import torch

from megatron_hetero.boundary.plan import RankPlan
from megatron_hetero.boundary.transfer import filled_index


def filled_slots(plan: RankPlan, device) -> torch.Tensor:
    """[filled] int64: the slots (of this rank's LLM input [b_local * seq], sample-major) that its
    boundary rows fill, in their order (cached on the plan; do not modify)."""
    key = ("filled", str(device))
    if key not in plan.cache:
        plan.cache[key] = torch.as_tensor(filled_index(plan), device=device)
    return plan.cache[key]


def input_rows(plan: RankPlan, b_local: int, device) -> torch.Tensor:
    """[filled] int64: where this rank's boundary rows go in its LLM input embedding, which is
    sequence-first [seq, b_local, h], as rows of its [seq * b_local, h] view (cached on the plan)."""
    key = ("input_rows", b_local, str(device))
    if key not in plan.cache:
        slots = filled_index(plan)
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
