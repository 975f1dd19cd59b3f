"""Whole (un-split, TP1/PP1) tensors of a module stage and back: for parity checks, layout-free
exports and loading weights (e.g. imported from Hugging Face) into any layout.

A TP-split parameter is cut the way megatron-core cuts it at initialization: along its
`partition_dim` into tp * `partition_stride` pieces, rank r holding pieces r, r + tp, ... (stride 2
is a gated MLP's fc1: the whole [gate; up] leaves [gate_r; up_r] on rank r). CP and DP ranks hold
whole copies; a pipeline stage holds its layers under their global numbers, an expert-parallel rank
its experts under theirs (init.whole_names). A padded vocabulary's weights have their TP-1 rows
(models/vocab.py: `whole_rows`).
"""

import torch
import torch.distributed as dist

from megatron_hetero.models.init import whole_names
from megatron_hetero.models.vocab import resized_rows


class FullStateError(ValueError):
    """A full state dict that does not fit the module; one line naming the tensor and the fix."""


def _split(param: torch.nn.Parameter) -> tuple[int, int]:
    """(partition dim, stride) of a TP-split parameter."""
    return param.partition_dim, getattr(param, "partition_stride", 1)


def tp_part(whole: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """TP rank `rank`'s part of `whole`."""
    return torch.cat(whole.chunk(tp * stride, dim)[rank::tp], dim)


def tp_whole(parts: list[torch.Tensor], dim: int, stride: int) -> torch.Tensor:
    """The whole tensor from every TP rank's part, in rank order (tp_part's inverse)."""
    pieces = [part.chunk(stride, dim) for part in parts]
    return torch.cat([rank_pieces[s] for s in range(stride) for rank_pieces in pieces], dim)


def is_expert(param: torch.nn.Parameter) -> bool:
    """An MoE expert's parameter (megatron-core marks them: reduced over expert DP, not DP)."""
    return not getattr(param, "allreduce", True)


def full_tensors(model: torch.nn.Module, tp_group, grads: bool = False, expert_tp_group=None,
                 experts: bool | None = None) -> dict[str, torch.Tensor]:
    """name -> the whole parameter (or its DP-reduced main_grad), gathered over `tp_group` (an
    expert's over `expert_tp_group`, by default the same); names are those of the pp=1, ep=1 module,
    so that the stages' and expert-parallel ranks' dictionaries merge into the whole module's.
    `experts`: only the experts' parameters (True), only the others (False), all (None).
    Collective over the TP and expert-TP groups."""
    result, names = {}, whole_names(model)
    for name, param in model.named_parameters():
        if experts is not None and is_expert(param) != experts:
            continue
        group = expert_tp_group if is_expert(param) and expert_tp_group is not None else tp_group
        local = (param.main_grad if grads else param).detach()
        if getattr(param, "tensor_model_parallel", False) and group.size() > 1:
            parts = [torch.empty_like(local) for _ in range(group.size())]
            dist.all_gather(parts, local.contiguous(), group=group)
            local = tp_whole(parts, *_split(param))
        if hasattr(param, "whole_rows"):
            local = resized_rows(local, param.whole_rows)
        result[names[name]] = local.float().cpu().clone()
    return result


@torch.no_grad()
def load_full_tensors(model: torch.nn.Module, full: dict[str, torch.Tensor], tp_group,
                      allow_missing: tuple[str, ...] = ()) -> None:
    """Set every parameter of this rank's stage `model` (any TP/PP/CP/DP layout) to its part of the
    whole module's tensor in `full` (names of the pp=1 module; full_tensors' inverse). Parameters
    whose whole name starts with one of `allow_missing` keep their values when `full` lacks them
    (e.g. the projector of an encoder imported without one). No communication."""
    names = whole_names(model)
    for name, param in model.named_parameters():
        whole_name = names[name]
        if whole_name not in full:
            if whole_name.startswith(allow_missing):
                continue
            raise FullStateError(f"{whole_name} is missing from the full state dict; give the whole "
                                 f"module's tensors (TP1/PP1 names)")
        tensor = full[whole_name]
        if hasattr(param, "whole_rows"):  # this layout's padded vocabulary
            tensor = resized_rows(tensor, param.shape[0] * tp_group.size())
        if getattr(param, "tensor_model_parallel", False):
            tensor = tp_part(tensor, *_split(param), tp_group.size(), tp_group.rank())
        if tensor.shape != param.shape:
            raise FullStateError(f"{whole_name}: this rank's part is {tuple(tensor.shape)}, the module holds "
                                 f"{tuple(param.shape)}; build the module with the checkpoint's sizes")
        param.copy_(tensor)


def gather_grad_shards(ddp) -> None:
    """Make every main_grad whole again under the distributed optimizer, where a DP rank holds the
    reduced gradient of its own shard of each bucket only: all-gather the shards over the DP (x CP)
    group, in place (the rest of the buffer held unreduced local sums that nothing reads). A no-op
    without it. Collective over that group."""
    if not ddp.ddp_config.use_distributed_optimizer:
        return
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:  # experts' over the expert DP group
        group = buffer.data_parallel_group
        for bucket in buffer.buckets:
            shard = bucket.grad_data.chunk(group.size())[group.rank()].clone()
            dist.all_gather_into_tensor(bucket.grad_data, shard, group=group)
