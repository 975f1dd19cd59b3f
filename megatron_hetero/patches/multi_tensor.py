"""megatron-core's optimizer step on torch's multi-tensor (foreach) kernels where it loops over the
parameters in Python: its fallbacks without Transformer Engine or apex (`utils.local_multi_tensor_l2_norm`
for the gradient norm, `utils.local_multi_tensor_scale` for the clip) and, with any of them, its copy of
the fp32 main params into bf16 weights (`optimizer._multi_tensor_copy_this_to_that`, a loop for bf16).

Upstream launches one or two kernels per parameter in each (per step: a norm, a multiply and a copy to
clip, a copy back to the weights), and the gradient norm read each parameter's norm on the host (357 of
the 383 host synchronizations in a profiled Qwen2.5-VL-7B-shaped step on one H200,
docs/runs/families_h200/). The optimizer step starts after a host wait for the backward, so the GPU idles
while the host walks the parameters. Here each is one foreach call over the list: its multi-tensor
kernels launch from C++, a few per pass, and the norm's total is reduced on the device (clip_grads' own
read of it is the step's one). The same arithmetic on the same values: on CPUs (foreach's per-tensor
path) bit for bit upstream's; on GPUs the clip and the copy round alike, and the per-parameter norms
are summed in another order.
"""

import torch

from megatron_hetero.patches._patch import replace


def l2_norm(tensor_lists) -> torch.Tensor:
    """upstream's: the l2 norm of every tensor of `tensor_lists`, float32 [1] on their device, no value
    read on the host."""
    norms = torch._foreach_norm([t for tensors in tensor_lists for t in tensors])
    return torch.norm(torch.stack(norms)).float().reshape(1)


def scale(tensor_lists, factor: float) -> None:
    """upstream's `dst.copy_(src * factor)` for each pair of fp32 tensor_lists = [src, dst] (the clip's
    gradients: upstream asserts fp32); in place where they are the same tensors (the clip's [grads,
    grads])."""
    src, dst = tensor_lists
    if not dst:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, factor)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, factor))


def _fp32(tensor_lists) -> bool:
    return all(t.dtype == torch.float32 for tensors in tensor_lists for t in tensors)


def _on_device(original):
    def local_multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        return l2_norm(tensor_lists), None  # no per-tensor norms, as upstream
    return local_multi_tensor_l2_norm


def _foreach_scale(original):
    def local_multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale_):
        if not _fp32(tensor_lists):  # foreach's CPU path rounds a Python factor to bf16 first
            return original(chunk_size, noop_flag, tensor_lists, scale_)
        scale(tensor_lists, scale_)
    return local_multi_tensor_scale


def _foreach_copy(original):
    def _multi_tensor_copy_this_to_that(this, that, overflow_buf=None):
        if overflow_buf is not None:  # fp16: upstream's multi-tensor scale (ours above without TE/apex)
            return original(this, that, overflow_buf)
        if this:
            torch._foreach_copy_(that, this)
    return _multi_tensor_copy_this_to_that


def apply() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as optimizer_module

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:  # neither TE's nor apex's kernels
        replace("megatron.core.optimizer.clip_grads.l2_norm_impl", _on_device, params=("tensor_lists",))
    for module in (clip_grads, optimizer_module):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            replace(f"{module.__name__}.multi_tensor_scale_impl", _foreach_scale, params=("tensor_lists", "scale"))
    replace("megatron.core.optimizer.optimizer._multi_tensor_copy_this_to_that", _foreach_copy,
            params=("this", "that", "overflow_buf"))
