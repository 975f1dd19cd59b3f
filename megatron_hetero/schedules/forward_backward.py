"""megatron.training's forward-backward function in a heterogeneous run (patches/hetero_schedule.py
hands it out under `--hetero-layout`).

`forward_backward` takes what megatron-core's schedules take (train_step and evaluate call it with
keywords) and returns Megatron's forward_data_store: the loss reports of the microbatches on ranks
that hold the LLM's last stage, empty elsewhere. It reads the step's microbatches, builds the
step's context (schedules/step.py: the script's calls captured, the boundary plans), runs the
placement's schedule and finalizes the gradients.
"""

import sys
import time

import torch.distributed as dist

from megatron_hetero.boundary import BoundaryMismatch
from megatron_hetero.parallel.context import Phase
from megatron_hetero.runtime.model import HeteroModel
from megatron_hetero.schedules.colocated import colocated_step
from megatron_hetero.schedules.non_colocated import non_colocated_step
from megatron_hetero.schedules.step import ScriptCalls, StepContext
from megatron_hetero.spec.layout import Placement

SCHEDULES = {Placement.COLOCATED: colocated_step, Placement.NON_COLOCATED: non_colocated_step}


def step_context(hetero: HeteroModel, forward_step_func, items: list, forward_only: bool) -> StepContext:
    """The step's context, prepared: every microbatch's call captured, every boundary planned (a
    boundary mismatch, raised on every rank at once: one line on rank 0, exit 1)."""
    ctx = StepContext(hetero.run, hetero.adapter, ScriptCalls(forward_step_func, items), hetero.config,
                      forward_only, hetero.clock, hetero.timers, hetero.plan_caches)
    try:
        ctx.prepare()
    except BoundaryMismatch as error:
        if dist.get_rank() == 0:
            print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(1)
    return ctx


def forward_backward(*, forward_step_func, data_iterator, model, num_microbatches, forward_only=False,
                     collect_non_loss_data=False, force_all_reduce=False, **_megatron_kwargs):
    """One step: the placement's schedule over `num_microbatches` global microbatches."""
    if collect_non_loss_data:
        raise NotImplementedError("collect_non_loss_data is not supported with --hetero-layout")
    (hetero,) = model
    assert isinstance(hetero, HeteroModel), type(hetero)
    hetero.run.enter(Phase.TRANSFERS)
    start = time.perf_counter()
    items = [next(data_iterator) if data_iterator is not None else None for _ in range(num_microbatches)]
    ctx = step_context(hetero, forward_step_func, items, forward_only)
    try:
        SCHEDULES[hetero.run.layout.placement](ctx)
    finally:
        ctx.finish()
    if not forward_only:
        hetero.run.enter(Phase.GRADIENT_REDUCTION)
        per_token = hetero.config.calculate_per_token_loss
        hetero.config.finalize_model_grads_func(
            [hetero], ctx.num_tokens if per_token else None, force_all_reduce=force_all_reduce)
        hetero.clock.step_s += time.perf_counter() - start
        hetero.traffic.add(ctx.plans, hetero.run.llm.name)
    hetero.run.enter(Phase.OPTIMIZER_STEP)
    return ctx.losses
