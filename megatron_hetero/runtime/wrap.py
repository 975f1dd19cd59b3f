"""This rank's built parts wrapped as Megatron trains a model chunk, but under each module's own
groups: tensor-parallel attribute defaults, the layout's `freeze`, the device, megatron-core DDP over
the module's data-parallel (x context-parallel) group; the result is one `HeteroModel` chunk, whose
gradients finalize_hetero_grads (grads.py) finalizes.

An encoder's rows feed the LLM's data-parallel ranks, whose losses Megatron averages over the LLM's
data-parallel size: so an encoder's DDP scales its reduced gradients by 1 / (LLM dp), not 1 / its own
dp (with --calculate-per-token-loss, gradients are summed and divided by the global token count).
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel

from megatron_hetero.runtime.grads import finalize_hetero_grads
from megatron_hetero.runtime.model import HeteroModel, ModelParts


def _scale_reduced_gradients(ddp: DistributedDataParallel, factor: float) -> None:
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor = factor


def wrap_parts(run, built: ModelParts, args) -> HeteroModel:
    """The HeteroModel over `built`; its run is `run` with the parts and their DDP wrappers."""
    from megatron.training.training import get_megatron_ddp_config

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    parts, ddps = {}, {}
    for name, module in run.modules.items():
        if not module.held:
            continue
        part = parts[name] = built.parts[name]
        for param in part.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if module.layout.freeze:
            part.requires_grad_(False)
        part.to(device)
        if args.bf16:  # bf16 weights; megatron-core's optimizer keeps fp32 main copies
            part.bfloat16()
        if not any(p.requires_grad for p in part.parameters()):
            continue
        ddp_config = get_megatron_ddp_config(args)  # one each: DDP sets some of its fields
        # finalize_hetero_grads checks each module's gradients itself, naming the module (DDP's own
        # check names a bucket only).
        ddp_config.check_for_nan_in_grad = False
        ddp = ddps[name] = DistributedDataParallel(part.config, ddp_config, part, pg_collection=module.pgs)
        if module.layout.role == "encoder" and not args.calculate_per_token_loss:
            _scale_reduced_gradients(ddp, 1.0 / run.layout.llm.dp)
    model = HeteroModel(run.with_parts(parts, ddps), built.adapter)
    model.config.finalize_model_grads_func = finalize_hetero_grads
    model.check_for_nan_in_grad = args.check_for_nan_in_loss_and_grad
    run.handles.model = model
    return model
