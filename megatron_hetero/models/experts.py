"""An MoE layer's experts on grouped GEMMs, where megatron-core 0.19 without Transformer Engine runs
SequentialMLP: per local expert a split of the tokens by host-side counts (`tokens_per_expert.tolist()`,
a host sync in every layer's forward), two GEMMs and the activation, launched expert by expert. At
Qwen3-VL-30B-A3B's 128 experts of ffn 768 those are hundreds of small GEMMs per layer.

GroupedExperts is SequentialMLP with its parameters as they are (local_experts.{e}.linear_fc1/2.weight:
checkpoints, the Hugging Face conversion and the EP / expert-TP sharding unchanged); its forward runs
fc1 and fc2 of all local experts as one torch._grouped_mm each, the groups ending at a cumulative sum
of the token counts computed on the device (no host sync). Same math as SequentialMLP, per token:
fc1, megatron-core's SwiGLU weighted by the routing probabilities (its fused kernel under
bias_activation_fusion, else the same elementwise operations), fc2; and the same gradients: each
expert's weight gradient, added to main_grad under gradient-accumulation fusion as megatron's linears
do (computed in bf16 by the grouped GEMM, then added in main_grad's dtype, as without the fusion).

The grouped GEMMs read each linear's weights as one [experts, out, in] tensor: the per-expert
parameters are views of one such tensor (GroupedExperts.pack, again after every move or cast of the
module), read without a copy. Where something else has placed them apart (megatron's distributed
optimizer puts every parameter into its own buffer), the forward and the backward each stack them:
a copy of the layer's expert weights each (not kept between the two: at full depth that would be
another copy of every layer's experts until its backward).

Where (the kernel policy's `experts`, MEGATRON_HETERO_EXPERTS_KERNEL): auto runs grouped on Hopper
GPUs (sm90) in bf16 with hidden and per-rank ffn widths that are multiples of 8 (torch's grouped
GEMM reads 16-byte-aligned rows; spec/sizes.grouped_experts_problem, which the planner shares),
sequential elsewhere; grouped runs it on every device (CPUs: torch's grouped GEMM in float32 / bf16,
and in other dtypes the same Function with a per-expert loop of megatron's linear's matmuls, which
the tests compare with SequentialMLP); sequential pins
SequentialMLP's forward. Configurations the grouped forward does not compute (another activation,
expert biases, FP8, delayed weight gradients, one local expert) keep SequentialMLP's forward.
"""

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.transformer.moe.experts import SequentialMLP

from megatron_hetero.models import kernel_policy
from megatron_hetero.models.attention_kernels import Device, current_device
from megatron_hetero.models.kernel_policy import EXPERTS_KERNEL_ENV
from megatron_hetero.models.mlp_kernels import main_grad_placeholder
from megatron_hetero.spec.sizes import GROUPED_EXPERTS_ALIGNMENT, grouped_experts_problem

GROUPED, SEQUENTIAL = "grouped", "sequential"
HAVE_GROUPED_MM = hasattr(torch, "_grouped_mm")  # torch 2.8 and later


@dataclass(frozen=True)
class ExpertsChoice:
    """kernel: GROUPED or SEQUENTIAL; reason: why not grouped."""

    kernel: str
    reason: str = ""

    def __str__(self) -> str:
        return self.kernel + (f" ({self.reason})" if self.reason else "")


def experts_mode(config, environ=os.environ) -> str:
    """The `experts` of the kernel policy of the layers built from `config` (with `environ`'s overrides)."""
    return kernel_policy.of(config, environ).experts


def unsupported(config, num_local_experts: int) -> str | None:
    """Why the grouped forward does not compute these experts as SequentialMLP would, if it does not."""
    if num_local_experts == 1:
        return "one local expert: one GEMM already"
    swiglu = config.gated_linear_unit and config.activation_func is F.silu
    if not swiglu or config.activation_func_clamp_value is not None or config.glu_linear_offset != 0:
        return "an activation other than SwiGLU"
    if config.add_bias_linear:
        return "expert biases"
    if (config.use_te_activation_func or config.fp8 or config.fp4 or config.delay_wgrad_compute
            or config.moe_apply_probs_on_input or config.moe_latent_size is not None):
        return "TE activations, FP8/FP4, delayed weight gradients, probabilities on the input or latent experts"
    return None


def choose_experts(mode: str, config, num_local_experts: int, widths: tuple[int, ...],
                   device: Device) -> ExpertsChoice:
    """The experts' forward under `mode` (EXPERTS_MODES) for `config`'s experts, with these per-rank
    GEMM widths (hidden, 2 ffn, ffn), on `device`."""
    if mode == SEQUENTIAL:
        return ExpertsChoice(SEQUENTIAL, f"{EXPERTS_KERNEL_ENV}=sequential")
    problem = unsupported(config, num_local_experts)
    if problem or mode == GROUPED:
        return ExpertsChoice(SEQUENTIAL, problem) if problem else ExpertsChoice(GROUPED)
    if device.capability is None:
        return ExpertsChoice(SEQUENTIAL, "no GPU")
    if not HAVE_GROUPED_MM:
        return ExpertsChoice(SEQUENTIAL, f"torch {torch.__version__} has no grouped GEMM")
    problem = grouped_experts_problem(device.capability[0], config.params_dtype == torch.bfloat16, widths)
    if problem:
        return ExpertsChoice(SEQUENTIAL, f"{device.name}, {config.params_dtype} weights: {problem}")
    return ExpertsChoice(GROUPED)


def aligned(*operands: torch.Tensor) -> bool:
    """Whether each 2-byte operand's rows (or columns, transposed: the larger of its last two strides)
    start 16 bytes apart, as torch's CUDA grouped GEMM requires."""
    return all(max(t.stride()[-2:]) % GROUPED_EXPERTS_ALIGNMENT == 0 for t in operands)


def grouped_mm_runs(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes a @ b here: CUDA in bf16 on aligned operands, CPUs in
    float32 / bf16; otherwise grouped_mm loops over the groups."""
    if not HAVE_GROUPED_MM or a.dtype != b.dtype:
        return False
    if a.is_cuda:
        return a.dtype == torch.bfloat16 and aligned(a, b)
    return a.dtype in (torch.float32, torch.bfloat16)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Per group g (rows ends[g-1]:ends[g] of the tokens): a_g @ b[g] for a [tokens, k] and b [groups,
    k, n] -> [tokens, n]; a[:, g] @ b_g for a [m, tokens] and b [tokens, n] -> [groups, m, n]."""
    if b.dim() == 2 and b.shape[0] == 0:  # no tokens at all: torch's GEMM refuses an empty contraction
        return a.new_zeros(len(ends), a.shape[0], b.shape[1])
    if b.dim() == 3 and a.shape[0] == 0:
        return a.new_zeros(0, b.shape[2])
    if grouped_mm_runs(a, b):
        return torch._grouped_mm(a, b, offs=ends)
    bounds = [0, *ends.tolist()]
    spans = [slice(start, end) for start, end in zip(bounds, bounds[1:])]
    if b.dim() == 3:
        return torch.cat([a[span].matmul(b_g) for span, b_g in zip(spans, b)])
    return torch.stack([a[:, span].matmul(b[span]) for span in spans])


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """The experts' weights as one [experts, out, in] tensor: a view where they are consecutive slices
    of one (GroupedExperts.pack), else a stacked copy."""
    first = weights[0]
    size = first.numel()
    storage = first.untyped_storage().data_ptr()
    if all(w.shape == first.shape and w.is_contiguous() and w.untyped_storage().data_ptr() == storage
           and w.storage_offset() == first.storage_offset() + e * size for e, w in enumerate(weights)):
        return first.detach().as_strided((len(weights), *first.shape), (size, first.shape[1], 1))
    return torch.stack(weights)


class _GroupedLinear(torch.autograd.Function):
    """y = x_g @ w_g^T for each local expert g's tokens (consecutive rows of x, ending at ends[g]).

    forward: the weights as one [experts, out, in] tensor (`stacked`) and one grouped GEMM;
    backward: dx = dy_g @ w_g (the weights so again) and dw_g = dy_g^T @ x_g, one grouped GEMM
    each; dw into each weight's main_grad under gradient-accumulation fusion (a placeholder returned
    where megatron's DDP expects one), else returned per expert."""

    @staticmethod
    def forward(ctx, x, ends, accumulation_fusion, *weights):
        ctx.save_for_backward(x, ends, *weights)
        ctx.accumulation_fusion = accumulation_fusion
        return grouped_mm(x, stacked(weights).transpose(1, 2), ends)

    @staticmethod
    def backward(ctx, dy):
        x, ends, *weights = ctx.saved_tensors
        dy = dy.contiguous()
        dx = grouped_mm(dy, stacked(weights), ends) if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[3:]):
            return dx, None, None, *(None for _ in weights)
        dw = grouped_mm(dy.t(), x, ends).unbind(0)
        if ctx.accumulation_fusion:
            main_grads = [weight.main_grad for weight in weights]
            torch._foreach_add_(main_grads, [grad.to(main.dtype) for grad, main in zip(dw, main_grads)])
            dw = [main_grad_placeholder(weight, x.dtype, x.device) for weight in weights]
        return dx, None, None, *dw


def weighted_swiglu(config, preact: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """megatron-core's MLP's SwiGLU of fc1's output weighted by each token's routing probability."""
    if config.bias_activation_fusion:
        return weighted_bias_swiglu_impl(preact, None, probs.unsqueeze(-1), config.activation_func_fp8_input_store)
    gate, up = torch.chunk(preact, 2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(preact.dtype)


class GroupedExperts(SequentialMLP):
    """megatron-core's SequentialMLP (same arguments and parameters); `choice` says whether its
    forward runs grouped GEMMs."""

    def __init__(self, num_local_experts, config, *args, **kwargs):
        super().__init__(num_local_experts, config, *args, **kwargs)
        fc1 = self.local_experts[0].linear_fc1.weight
        widths = (*fc1.shape, fc1.shape[0] // 2)
        self.choice = choose_experts(experts_mode(self.config), self.config, num_local_experts, widths,
                                     current_device())
        self.pack()

    def pack(self) -> None:
        """Each linear's expert weights as views of one [experts, out, in] tensor (where the grouped
        GEMMs run): the same parameters, values and names."""
        if getattr(self, "choice", None) != ExpertsChoice(GROUPED):  # (a move before __init__ has chosen)
            return
        for name in ("linear_fc1", "linear_fc2"):
            weights = [getattr(expert, name).weight for expert in self.local_experts]
            for weight, view in zip(weights, torch.stack([w.data for w in weights])):
                weight.data = view

    def _apply(self, fn, *args, **kwargs):
        # A move or cast (module.cuda(), Float16Module's bfloat16()) gives each parameter new data.
        super()._apply(fn, *args, **kwargs)
        self.pack()
        return self

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if self.choice.kernel != GROUPED:
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        ends = tokens_per_expert.to(x.device, non_blocking=True).cumsum(0).to(torch.int32)
        fusion = self.local_experts[0].linear_fc1.gradient_accumulation_fusion
        preact = _GroupedLinear.apply(x, ends, fusion, *(e.linear_fc1.weight for e in self.local_experts))
        act = weighted_swiglu(self.config, preact, permuted_probs)
        return _GroupedLinear.apply(act, ends, fusion, *(e.linear_fc2.weight for e in self.local_experts)), None


def experts_summary(module: torch.nn.Module) -> str:
    """The kernels a model part's MoE experts run (e.g. "grouped", "sequential (no GPU)"); "none"
    for a part without them."""
    found = [str(sub.choice) for sub in module.modules() if isinstance(sub, GroupedExperts)]
    return "; ".join(dict.fromkeys(found)) or "none"
