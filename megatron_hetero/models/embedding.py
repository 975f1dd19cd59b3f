"""The LLM's input embedding with its weight gradient added into main_grad by its own backward, on GPUs.

Why: megatron-core's VocabParallelEmbedding looks its rows up with F.embedding, whose backward writes a
dense [vocabulary, hidden] gradient in the weight's dtype (zeros but for the microbatch's tokens), which
megatron's DDP hook then adds to the fp32 main_grad: two passes over the whole table per microbatch. In
the Qwen2.5-VL-7B-shaped step on one H200 (152,064 x 3,584, 4 microbatches; docs/runs/h200_one_card/
windows_flash/ab/profile_B_qwen2_5_vl_7b.md) the add alone took 8.9 ms and a copy of the table 3.5 ms.
Here the backward adds each token's gradient row into main_grad at its id (index_add_, in main_grad's
fp32: duplicates sum there, not first in bf16; atomic adds, or torch's deterministic kernel under
--deterministic-mode; index_put_ accumulating took 5.1 ms per microbatch in a later profile) and hands
autograd the placeholder megatron's DDP expects from a layer that did so itself
(grad_added_to_main_grad), as megatron-core's linear layers do under gradient-accumulation fusion.

Where: weights that megatron's DDP gave a main_grad, on a GPU, with grad enabled, for F.embedding's
plain call (no padding_idx, max_norm, ...); elsewhere F.embedding as upstream (CPUs: the tests' and
parity runs' numbers bit for bit). MEGATRON_HETERO_EMBEDDING_GRAD=torch keeps upstream's everywhere.
"""

import torch
import torch.nn.functional as F

from megatron_hetero.models import kernel_policy
from megatron_hetero.models.mlp_kernels import main_grad_placeholder


def into_main_grad(weight: torch.Tensor) -> bool:
    """Whether a lookup in `weight` adds its gradient into the weight's main_grad itself."""
    return (weight.is_cuda and weight.requires_grad and torch.is_grad_enabled()
            and getattr(weight, "main_grad", None) is not None and hasattr(weight, "grad_added_to_main_grad")
            and kernel_policy.mode_now("embedding_grad") == "auto")


class _EmbeddingIntoMainGrad(torch.autograd.Function):
    """forward: weight[ids] (F.embedding);
    backward: weight.main_grad[ids] += grad (added in main_grad's dtype), a placeholder returned."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad):
        ids, weight = ctx.saved_tensors
        rows = grad.reshape(-1, grad.shape[-1]).to(weight.main_grad.dtype)
        weight.main_grad.index_add_(0, ids.reshape(-1), rows)
        return None, main_grad_placeholder(weight, grad.dtype, grad.device)


def embedding(input: torch.Tensor, weight: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """F.embedding, the gradient into main_grad where into_main_grad says (a plain call only)."""
    if args or kwargs or not into_main_grad(weight):
        return F.embedding(input, weight, *args, **kwargs)
    return _EmbeddingIntoMainGrad.apply(input, weight)
