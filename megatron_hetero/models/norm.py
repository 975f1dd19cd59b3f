"""LayerNorm / RMSNorm for megatron-core layer specs without Transformer Engine, correct under
sequence parallelism on its own.

With sequence parallelism each TP rank normalizes its own part of the sequence, so each rank's
weight (and bias) gradient covers only its tokens. Megatron leaves the TP sum of those partial
gradients to `finalize_model_grads` (params marked `sequence_parallel=True`). Here the sum happens
in the backward pass itself: the parameters enter the norm through megatron's
`copy_to_tensor_model_parallel_region` (forward: identity, backward: all-reduce over TP), one
all-reduce of 2*hidden (LayerNorm) or hidden (RMSNorm) values per norm and microbatch.
After backward the gradients are whole and equal on every TP rank; DDP then sums them over DP/CP.

The parameters are deliberately NOT marked `sequence_parallel=True`: that attribute only tells
`finalize_model_grads` to all-reduce them over TP, which would count them TP times here. So
`finalize_model_grads` (e.g. megatron.training's train_step) stays correct with this norm too.

Query/key norms (Qwen3's QK-norm: one RMSNorm over each head) see whole sequences of this rank's
heads, sequence parallel or not: built with `over_sequence=False` they never sum over TP themselves;
megatron's `finalize_model_grads` sums their partial (per-head-slice) gradients over TP, by name
(`q_layernorm`, `k_layernorm`), as it does for Transformer Engine's.

The kernels: quack's fused forward and backward on Hopper/Blackwell GPUs where it imports, torch's
elsewhere (norm_kernels.py: why, and how to pin torch's), or for the calls quack does not take our Triton
kernels under MEGATRON_HETERO_SMALL_NORM=triton (small_norm.py).

A layer's norms (has_residual, megatron-core's convention for Transformer Engine's fused residual
RMSNorm: TransformerLayer unpacks (output, residual)) hand their input back as the residual, so that
its two gradients (through the norm, and the residual add's) meet in the norm's backward: quack's
adds the second into the input gradient it writes, where autograd would add them in one more pass
over the activations.
"""

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models import kernel_policy, small_norm
from megatron_hetero.models.norm_kernels import load_quack, norm_kernel_for, quack_norm


class SequenceParallelNorm(torch.nn.Module):
    """`config.normalization` ("LayerNorm" or "RMSNorm") over the last dimension; parameters named
    like torch's (weight, and bias for LayerNorm) so checkpoints match megatron's WrappedTorchNorm.

    tp_group is needed when config.sequence_parallel and TP > 1: bind it in the spec
    (functools.partial), since megatron builds norms from (config, hidden_size, eps) alone.
    over_sequence=False: a norm whose input is not split over the sequence (query/key norms).
    has_residual: a layer's norm before a residual add, which returns (output, its input) where
    passes_residual(config)."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        tp_group: torch.distributed.ProcessGroup | None = None,
        over_sequence: bool = True,
        has_residual: bool = False,
    ):
        super().__init__()
        self.has_residual = has_residual and passes_residual(config)
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {config.normalization!r} is not LayerNorm or RMSNorm")
        sums_over_tp = over_sequence and config.sequence_parallel and config.tensor_model_parallel_size > 1
        if sums_over_tp and tp_group is None:
            raise ValueError("sequence_parallel with TP > 1 needs the norm's tp_group (bind it in the spec)")
        self.grad_sum_group = tp_group if sums_over_tp else None
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        # Zero-centered gamma stores weight - 1 (weight decay pulls the scale towards 1, not 0).
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if not self.rms:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))
        policy = kernel_policy.of(config)
        self.kernel = norm_kernel_for(policy)
        self.small_on_triton = policy.small_norm == "triton"  # the calls quack does not take: small_norm.py

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [self.weight] if self.rms else [self.weight, self.bias]
        if self.grad_sum_group is not None:
            # One all-reduce for weight and bias together, in the backward pass.
            stacked = copy_to_tensor_model_parallel_region(torch.stack(params), self.grad_sum_group)
            params = list(stacked.unbind(0))
        if self.zero_centered_gamma:
            params[0] = params[0] + 1
        weight, bias = params[0], None if self.rms else params[1]
        if self.kernel.runs_quack(x.numel()):
            return quack_norm(x, weight, bias, self.eps, self.rms, load_quack()[0], self.has_residual)
        if self.small_on_triton and small_norm.takes(x, weight, bias):
            return small_norm.small_norm(x, weight, bias, self.eps, self.rms, self.has_residual)
        if self.rms:
            out = F.rms_norm(x, x.shape[-1:], weight, self.eps)
        else:
            out = F.layer_norm(x, x.shape[-1:], weight, bias, self.eps)
        return (out, x) if self.has_residual else out


def passes_residual(config: TransformerConfig) -> bool:
    """Whether a layer's norms may return (output, residual): not where megatron checkpoints a norm
    alone (selective recompute of "layernorm": its checkpoint frees the outputs' storage, the
    residual's with them) or offloads its input."""
    recomputed = config.recompute_granularity == "selective" and "layernorm" in (config.recompute_modules or ())
    return not recomputed and not config.fine_grained_activation_offloading


def norm_summary(module: torch.nn.Module) -> str:
    """The kernels a model part's norms run (e.g. "quack", "torch (no GPU)"), for the start-up line and
    benchmark records; "none" for a part without our norms."""
    def smaller(sub) -> str:
        on_triton = sub.small_on_triton and small_norm.HAVE_TRITON and torch.cuda.is_available()
        return "; the calls quack does not take on Triton" if on_triton else ""
    found = [str(sub.kernel) + smaller(sub) for sub in module.modules() if isinstance(sub, SequenceParallelNorm)]
    return "; ".join(dict.fromkeys(found)) or "none"
