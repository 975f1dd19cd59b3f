"""The gradient norm without a host wait per parameter where megatron-core computes it itself
(megatron-core 0.19 `optimizer.clip_grads`: without Transformer Engine or apex its `l2_norm_impl` is
`utils.local_multi_tensor_l2_norm`, which turns every parameter's norm into a Python float, one wait
for the GPU each: 357 in one step of the Qwen2.5-VL-7B-shaped bench on an H200, in its profile's
host_syncs). On GPUs each tensor's norm comes from torch's foreach kernel and their norm stays on the
device: upstream's [1] float32 result, equal up to the fp32 rounding of the sum's order. CPU runs keep
upstream's function (the tests' references), as do installs whose apex or TE kernel is the impl.
"""

import torch

from megatron_hetero.patches._patch import replace

DEVICE_TYPES = ("cuda",)  # where the norm stays on the device
PARAMS = ("chunk_size", "noop_flag", "tensor_lists", "per_tensor")


def _l2_norm(upstream):
    def l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
        tensors = [t for tensor_list in tensor_lists for t in tensor_list]
        if not tensors or any(t.device.type not in DEVICE_TYPES for t in tensors):
            return upstream(chunk_size, noop_flag, tensor_lists, per_tensor, *args)
        norms = torch.stack([norm.float() for norm in torch._foreach_norm(tensors)])
        return torch.linalg.vector_norm(norms).reshape(1), None  # upstream's per-tensor result is None too
    return l2_norm


def apply() -> None:
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        replace("megatron.core.optimizer.clip_grads.l2_norm_impl", _l2_norm, params=PARAMS)
