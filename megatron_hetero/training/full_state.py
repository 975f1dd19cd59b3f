"""Whole (un-split) tensors of a TP-sharded module stage: for parity checks and layout-free exports."""

import torch
import torch.distributed as dist

from megatron_hetero.models.init import whole_names


def full_tensors(model: torch.nn.Module, tp_group, grads: bool = False) -> dict[str, torch.Tensor]:
    """name -> the whole parameter (or its DP-reduced main_grad), gathered over `tp_group` along
    each TP-split parameter's partition_dim; names are those of the pp=1 module, so that the stages'
    dictionaries merge into the whole module's. Collective over the TP group."""
    result, names = {}, whole_names(model)
    for name, param in model.named_parameters():
        local = (param.main_grad if grads else param).detach()
        if getattr(param, "tensor_model_parallel", False) and tp_group.size() > 1:
            parts = [torch.empty_like(local) for _ in range(tp_group.size())]
            dist.all_gather(parts, local.contiguous(), group=tp_group)
            local = torch.cat(parts, dim=param.partition_dim)
        result[names[name]] = local.float().cpu().clone()
    return result
