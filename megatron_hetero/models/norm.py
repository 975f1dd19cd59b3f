"""LayerNorm / RMSNorm for megatron-core layer specs without Transformer Engine, correct under
sequence parallelism on its own.

With sequence parallelism each TP rank normalizes its own part of the sequence, so each rank's
weight (and bias) gradient covers only its tokens. Megatron leaves the TP sum of those partial
gradients to `finalize_model_grads` (params marked `sequence_parallel=True`). Here the sum happens
in the backward pass itself: the parameters enter the norm through megatron's
`copy_to_tensor_model_parallel_region` (forward: identity, backward: all-reduce over TP), one
all-reduce of 2*hidden (LayerNorm) or hidden (RMSNorm) values per norm and microbatch.
After backward the gradients are whole and equal on every TP rank; DDP then sums them over DP/CP.

In a transformer layer (`residual_out`, bound in the layer spec) and with
`--hetero-fused-residual-norm` (which sets FUSED_RESIDUAL_ENV), the norm also returns its input as the
layer's residual (megatron-core's TransformerLayer takes a norm's (output, residual) pair, as from
Transformer Engine's fused residual RMSNorm): its backward then adds the residual's gradient to the
norm's input gradient in the same pass (compiled on GPUs: one row reduction instead of the norm's
backward and a separate add over the hidden states), for LayerNorm and RMSNorm alike.

The parameters are deliberately NOT marked `sequence_parallel=True`: that attribute only tells
`finalize_model_grads` to all-reduce them over TP, which would count them TP times here. So
`finalize_model_grads` (e.g. megatron.training's train_step) stays correct with this norm too.
"""

import os

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region
from megatron.core.transformer.transformer_config import TransformerConfig

# Set (to "1") by --hetero-fused-residual-norm (patches/arguments.py) before the model is built.
FUSED_RESIDUAL_ENV = "MEGATRON_HETERO_FUSED_RESIDUAL_NORM"


def norm_backward(grad: torch.Tensor, residual_grad: torch.Tensor | None, x: torch.Tensor, weight: torch.Tensor,
                  has_bias: bool, eps: float, rms: bool) -> tuple:
    """(input gradient + residual_grad, weight gradient, bias gradient or None) of LayerNorm/RMSNorm
    over the last dimension, in fp32 as torch's kernels compute them."""
    xf, gf = x.float(), grad.float()
    mean = None if rms else xf.mean(-1, keepdim=True)
    centered = xf if rms else xf - mean
    rstd = torch.rsqrt(centered.square().mean(-1, keepdim=True) + eps)
    xhat = centered * rstd
    dxhat = gf * weight.float()
    inner = dxhat - (dxhat * xhat).mean(-1, keepdim=True) * xhat
    if not rms:
        inner = inner - dxhat.mean(-1, keepdim=True)
    dx = inner * rstd
    if residual_grad is not None:
        dx = dx + residual_grad.float()
    rows = tuple(range(x.dim() - 1))
    dw = (gf * xhat).sum(rows).to(weight.dtype)
    db = gf.sum(rows).to(weight.dtype) if has_bias else None
    return dx.to(x.dtype), dw, db


_compiled_backward = None


class ResidualNorm(torch.autograd.Function):
    """forward: (norm(x), x), the second the layer's residual; backward: the input gradient is the
    norm's plus the residual's, computed in one pass (norm_backward, compiled on GPUs)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.rms, ctx.has_bias = eps, rms, bias is not None
        out = F.rms_norm(x, x.shape[-1:], weight, eps) if rms else F.layer_norm(x, x.shape[-1:], weight, bias, eps)
        return out, x.view_as(x)

    @staticmethod
    def backward(ctx, grad, residual_grad):
        global _compiled_backward
        x, weight = ctx.saved_tensors
        function = norm_backward
        if x.is_cuda:
            if _compiled_backward is None:
                _compiled_backward = torch.compile(norm_backward)
            function = _compiled_backward
        dx, dw, db = function(grad, residual_grad, x, weight, ctx.has_bias, ctx.eps, ctx.rms)
        return dx, dw, db, None, None


class SequenceParallelNorm(torch.nn.Module):
    """`config.normalization` ("LayerNorm" or "RMSNorm") over the last dimension; parameters named
    like torch's (weight, and bias for LayerNorm) so checkpoints match megatron's WrappedTorchNorm.

    tp_group is needed when config.sequence_parallel and TP > 1: bind it in the spec
    (functools.partial), since megatron builds norms from (config, hidden_size, eps) alone.
    residual_out: a norm inside a transformer layer, which returns (output, residual) when the
    fusion is on (FUSED_RESIDUAL_ENV) and the layer does not recompute its norms."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        tp_group: torch.distributed.ProcessGroup | None = None,
        residual_out: bool = False,
    ):
        super().__init__()
        if config.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization {config.normalization!r} is not LayerNorm or RMSNorm")
        sums_over_tp = config.sequence_parallel and config.tensor_model_parallel_size > 1
        if sums_over_tp and tp_group is None:
            raise ValueError("sequence_parallel with TP > 1 needs the norm's tp_group (bind it in the spec)")
        self.grad_sum_group = tp_group if sums_over_tp else None
        self.rms = config.normalization == "RMSNorm"
        self.eps = eps
        recomputed = "layernorm" in (config.recompute_modules or ()) and config.recompute_granularity == "selective"
        self.residual_out = residual_out and os.environ.get(FUSED_RESIDUAL_ENV) == "1" and not recomputed
        # Zero-centered gamma stores weight - 1 (weight decay pulls the scale towards 1, not 0).
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        init = torch.zeros if self.zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(hidden_size, dtype=config.params_dtype))
        self.bias = None
        if not self.rms:
            self.bias = torch.nn.Parameter(torch.zeros(hidden_size, dtype=config.params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [self.weight] if self.rms else [self.weight, self.bias]
        if self.grad_sum_group is not None:
            # One all-reduce for weight and bias together, in the backward pass.
            stacked = copy_to_tensor_model_parallel_region(torch.stack(params), self.grad_sum_group)
            params = list(stacked.unbind(0))
        if self.zero_centered_gamma:
            params[0] = params[0] + 1
        if self.residual_out:
            return ResidualNorm.apply(x, params[0], None if self.rms else params[1], self.eps, self.rms)
        if self.rms:
            return F.rms_norm(x, x.shape[-1:], params[0], self.eps)
        return F.layer_norm(x, x.shape[-1:], params[0], params[1], self.eps)
