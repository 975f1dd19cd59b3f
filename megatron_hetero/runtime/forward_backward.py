"""megatron.training's forward-backward function and gradient finalization for a heterogeneous run.

`forward_backward` takes what megatron-core's schedules take (train_step and evaluate call it with
keywords) and returns Megatron's forward_data_store: the loss reports of the microbatches on ranks
that hold the LLM's last stage, empty elsewhere.
"""

import sys
import time

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.rerun_state_machine import get_rerun_state_machine

from megatron_hetero.boundary import BoundaryMismatch
from megatron_hetero.runtime.model import HeteroModel
from megatron_hetero.runtime.step import StepContext
from megatron_hetero.schedules.colocated import colocated_step
from megatron_hetero.schedules.non_colocated import non_colocated_step

SCHEDULES = {"colocated": colocated_step, "non_colocated": non_colocated_step}


def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                     collect_non_loss_data=False, force_all_reduce=False, **_megatron_kwargs):
    """One step: the placement's schedule over `num_microbatches` global microbatches."""
    if collect_non_loss_data:
        raise NotImplementedError("collect_non_loss_data is not supported with --hetero-layout")
    (hetero,) = model
    assert isinstance(hetero, HeteroModel), type(hetero)
    hetero.run.phase = "the pipeline's transfers"
    start = time.perf_counter()
    items = [next(data_iterator) if data_iterator is not None else None for _ in range(num_microbatches)]
    ctx = StepContext(hetero.run, hetero.adapter, forward_step_func, items, hetero.config, forward_only,
                      hetero.clock, hetero.timers, hetero.plan_caches)
    try:
        ctx.prepare()
    except BoundaryMismatch as error:  # raised on every rank at once, with the same line
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    if not forward_only:
        ctx.hold_grad_sync()
    try:
        SCHEDULES[hetero.run.layout.placement](ctx)
    finally:
        ctx.release_grad_sync()
    if not forward_only:
        hetero.run.phase = "the gradient reduction"
        per_token = hetero.config.calculate_per_token_loss
        hetero.config.finalize_model_grads_func(
            [hetero], ctx.num_tokens if per_token else None, force_all_reduce=force_all_reduce)
        hetero.clock.step_s += time.perf_counter() - start
    hetero.run.phase = "the optimizer step"  # and Megatron's logging, up to the next step
    return ctx.losses


def finalize_hetero_grads(model, num_tokens=None, pg_collection=None, force_all_reduce=False):
    """megatron-core's finalize_model_grads per module, each over its own groups; with per-token
    loss every module's gradients are divided by the global number of loss tokens."""
    (hetero,) = model
    run = hetero.run
    total = None
    if num_tokens is not None:
        # Loss tokens of the global batch: counted on the LLM's last stage, once per (dp, cp).
        total = torch.zeros((), dtype=torch.float64, device=num_tokens.device)
        llm = run.llm
        if llm.last_stage and llm.coords()["tp"] == 0:
            total += num_tokens.double()
        dist.all_reduce(total)
    for module in run.modules.values():
        if module.ddp is None:
            continue
        if hetero.check_for_nan_in_grad:
            check_finite_grads(module)
        finalize_model_grads([module.ddp], None, pg_collection=module.pgs, force_all_reduce=force_all_reduce)
        if total is not None:
            module.ddp.scale_gradients(1.0 / total.clamp(min=1).item())


def check_finite_grads(module) -> None:
    """megatron-core DDP's check of this rank's gradients before their data-parallel reduction
    (`--check-for-nan-in-loss-and-grad`, through Megatron's rerun state machine: rerun, then stop),
    with a message naming the module."""
    ddp = module.ddp
    norm = torch.linalg.vector_norm(torch.stack(
        [buffer.grad_data.norm(p=2) for buffer in ddp.buffers + ddp.expert_parallel_buffers]))
    for rejected, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
        get_rerun_state_machine().validate_result(
            result=norm, rejection_func=rejected, tolerance=0.001, fatal=True,
            message=f"found {what} in the gradients of module {module.name} on this rank, before their "
                    f"data-parallel reduction")
