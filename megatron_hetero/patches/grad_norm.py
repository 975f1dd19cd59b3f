"""The gradient norm without a host read per parameter (megatron-core 0.19 `optimizer.clip_grads`'s
fallback without Transformer Engine or apex: `utils.local_multi_tensor_l2_norm`).

Upstream computes each gradient's norm on the device, then gathers them into a host tensor
(`torch.tensor` of device scalars): one read, and so one wait for the GPU, per parameter: 357 of the 383
host synchronizations in a profiled Qwen2.5-VL-7B-shaped step on one H200 (docs/runs/families_h200/),
the GPU idle between each. Here the norms are stacked and reduced on the device; clip_grads' own read
of the total is the step's one. The same kernels on the same values: on CPUs the same norm bit for bit;
on GPUs the last reduction (of one norm per parameter) runs on the device instead of the host.
"""

import torch

from megatron_hetero.patches._patch import replace


def l2_norm(tensor_lists) -> torch.Tensor:
    """upstream's: the l2 norm of every tensor of `tensor_lists`, float32 [1] on their device, no value
    read on the host."""
    norms = torch.stack([torch.norm(t) for tensors in tensor_lists for t in tensors])
    return torch.norm(norms).float().reshape(1)


def _on_device(original):
    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        return l2_norm(tensor_lists), None  # no per-tensor norms, as upstream
    return local_multi_tensor_l2_norm


def apply() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:  # neither TE's nor apex's kernel
        replace("megatron.core.optimizer.clip_grads.l2_norm_impl", _on_device, params=("tensor_lists",))
