"""Gradient finalization for a heterogeneous run (megatron.training's finalize_model_grads_func):
each module's gradients reduced over its own groups and checked for NaN/Inf, naming the module."""

import torch
import torch.distributed as dist
from megatron.core.distributed import finalize_model_grads
from megatron.core.rerun_state_machine import get_rerun_state_machine


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
