"""megatron-core's dense MLP with the activation inside its GEMMs where quack can run them
(mlp_kernels.py: why, where, and how to pin torch's); a SwiGLU MLP with a per-rank ffn whose bf16
rows are not 16-byte aligned on GEMMs of the ffn zero-padded to alignment, quack's or, where quack
does not run it, torch's (padded_swiglu_mlp); megatron-core's own forward everywhere else, with fc1's
bias and a plain activation as one compiled kernel where megatron-core has none (fuses_bias_activation;
erf GELU's on our Triton kernel under MEGATRON_HETERO_BIAS_GELU=triton: bias_gelu.py).

The same module as megatron-core's MLP (its linear_fc1 / linear_fc2 parameters, names, checkpoints
and TP sharding unchanged); only the forward differs where the epilogue path runs. Its communication
is what megatron's ColumnParallelLinear / RowParallelLinear do around their GEMMs, through
megatron-core's mappings and the MLP's own TP group: fc1's input gathered over the sequence
(sequence parallelism; backward: reduce-scatter) or copied into the TP region (backward:
all-reduce), fc2's output reduce-scattered or all-reduced. fc2's bias is returned apart, as the
layer's bias-dropout-add expects (megatron builds both linears with skip_bias_add). Under sequence
parallelism fc1's gathered input is kept for its weight gradient (megatron's linear gathers it again in
the backward instead): (TP - 1) / TP more hidden-wide rows per token, against the activation's
ffn / TP no longer kept.
"""

import dataclasses

import torch
from megatron.core.jit import jit_fuser
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import MLP

from megatron_hetero.models import bias_gelu, kernel_policy
from megatron_hetero.models.attention_kernels import current_device
from megatron_hetero.models.kernel_policy import GATED_BIAS_MLP_CHECKED, MLP_KERNEL_ENV
from megatron_hetero.models.mlp_kernels import (
    EPILOGUE_DTYPES,
    GATED,
    epilogue_mlp,
    load_quack_gemm,
    mlp_kernel_for,
    padded_swiglu_mlp,
    quack_activation,
)
from megatron_hetero.models.quack_kernels import QUACK, TORCH, QuackChoice

ALIGNMENT = 8  # elements: the 16-byte row alignment quack's (TMA) GEMMs need at 2 bytes per element


def _own_forward_problem(config, fc1, fc2) -> str | None:
    """Why an MLP of `config` with these linears must keep megatron-core's forward, if it must."""
    if type(fc1) is not ColumnParallelLinear or type(fc2) is not RowParallelLinear:
        return f"linears {type(fc1).__name__} / {type(fc2).__name__}"
    if fc1.is_expert or fc1.disable_grad_reduce or config.fp8 or config.delay_wgrad_compute:
        return "an expert, FP8 or delayed weight-gradient MLP"
    return None


def _bias_activation(x: torch.Tensor, bias: torch.Tensor, activation) -> torch.Tensor:
    return activation(x + bias)


# One compiled kernel each way (megatron-core's jit_fuser: torch.compile) for the bias add and activation
# that megatron-core's MLP runs as two eager passes forward and more backward where it has no fused kernel
# for the function (its bias_gelu_impl computes GELU's tanh approximation, not erf's).
_bias_activation_fused = jit_fuser(_bias_activation)


def fuses_bias_activation(config, fc1, fc2) -> bool:
    """Whether an MLP of `config` with these linears, where megatron-core's forward runs, adds fc1's bias
    and applies its plain (not gated) activation in one compiled kernel: under --bias-dropout-fusion
    (megatron's switch for its compiled elementwise kernels; off without a GPU), where megatron-core
    would run them as two unfused steps."""
    return (config.bias_dropout_fusion and fc1.bias is not None and not config.gated_linear_unit
            and not config.bias_activation_fusion and not config.use_te_activation_func
            and _own_forward_problem(config, fc1, fc2) is None)


def epilogue_choice(config, fc1, fc2, kernel: QuackChoice) -> QuackChoice:
    """Whether an MLP of `config` with these linears runs its activation in quack's GEMMs, given the
    kernel choice of its policy (mlp_kernel_for); the reason where it does not."""
    if kernel.kernel != QUACK:
        return kernel
    activation = quack_activation(config)
    if config.params_dtype not in EPILOGUE_DTYPES:
        return QuackChoice(TORCH, f"{config.params_dtype} activations: quack's GEMMs take bf16 / fp16")
    if activation is None:
        return QuackChoice(TORCH, "an activation quack's epilogues do not compute")
    problem = _own_forward_problem(config, fc1, fc2)
    if problem:
        return QuackChoice(TORCH, problem)
    if (activation in GATED and fc1.bias is not None and kernel_policy.of(config).mlp != QUACK
            and (device := current_device().name) not in GATED_BIAS_MLP_CHECKED):
        return QuackChoice(TORCH, f"a gated MLP with fc1 biases (quack's gated bias layout not checked on {device}: "
                                  f"megatron-hetero kernels check mlp --record; {MLP_KERNEL_ENV}=quack runs it)")
    # A gated unit's ffn is zero-padded to alignment where it is not (ffn_padding).
    widths = fc1.weight.shape[1:] if activation in GATED else fc1.weight.shape
    if any(width % ALIGNMENT for width in widths):
        return QuackChoice(TORCH, f"fc1 of {tuple(fc1.weight.shape)} per TP rank: quack's GEMMs need widths "
                                  f"that are multiples of {ALIGNMENT}")
    return dataclasses.replace(kernel, reason=activation)


def gated_ffn_padding(ffn: int) -> int:
    """Zero columns that take a gated unit's per-rank ffn to a multiple of ALIGNMENT."""
    return -ffn % ALIGNMENT


def ffn_padding(config, fc1, fc2, kernel: QuackChoice) -> int:
    """Zero columns that take a SwiGLU MLP's per-rank ffn to a multiple of ALIGNMENT in bf16 / fp16, on
    quack's GEMMs (epilogue_mlp) or torch's (padded_swiglu_mlp); 0 where none are needed or the config's
    policy pins megatron-core's MLP (MEGATRON_HETERO_MLP_KERNEL=torch)."""
    if (kernel_policy.of(config).mlp == TORCH or quack_activation(config) not in GATED
            or config.params_dtype not in EPILOGUE_DTYPES or _own_forward_problem(config, fc1, fc2)):
        return 0
    return gated_ffn_padding(fc2.weight.shape[1])


def epilogue_input(x: torch.Tensor) -> bool:
    """Whether quack's GEMMs take this input: bf16 / fp16 on the GPU."""
    return x.is_cuda and x.dtype in EPILOGUE_DTYPES


class EpilogueMLP(MLP):
    """megatron-core's MLP (same arguments and parameters); `epilogue` says whether its activation
    runs in quack's GEMMs, where inputs are bf16 / fp16 on the GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        kernel = mlp_kernel_for(kernel_policy.of(self.config))
        self.epilogue = epilogue_choice(self.config, self.linear_fc1, self.linear_fc2, kernel)
        self.pad = ffn_padding(self.config, self.linear_fc1, self.linear_fc2, self.epilogue)
        if self.pad:
            ffn = self.linear_fc2.weight.shape[1]
            self.epilogue = dataclasses.replace(
                self.epilogue, reason=f"{self.epilogue.reason}; ffn {ffn} zero-padded to {ffn + self.pad}")
        self.activation = quack_activation(self.config)
        self.fused_bias_activation = fuses_bias_activation(self.config, self.linear_fc1, self.linear_fc2)

    def forward(self, hidden_states: torch.Tensor, per_token_scale: torch.Tensor | None = None, **kwargs):
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        # fc1's multiply-adds (spec/sizes.py MLP_MIN_MACS): its GEMM takes the gathered sequence under SP.
        gathered = fc1.tp_group.size() if fc1.sequence_parallel else 1
        quack = self.epilogue.runs_quack(hidden_states.numel() * gathered * fc1.weight.shape[0])
        if (not (quack or self.pad) or per_token_scale is not None or not epilogue_input(hidden_states)):
            if self.fused_bias_activation and per_token_scale is None:
                intermediate, bias = fc1(hidden_states)
                if bias_gelu.runs_kernel(intermediate, bias, self.config.activation_func):
                    return fc2(bias_gelu.bias_gelu(intermediate, bias))
                return fc2(_bias_activation_fused(intermediate, bias, self.config.activation_func))
            return super().forward(hidden_states, per_token_scale, **kwargs)
        if fc1.sequence_parallel:
            x = gather_from_sequence_parallel_region(hidden_states, group=fc1.tp_group)
        else:
            x = copy_to_tensor_model_parallel_region(hidden_states, group=fc1.tp_group)
        if quack:
            out = epilogue_mlp(x, fc1.weight, fc1.bias, fc2.weight, self.activation,
                               fc1.gradient_accumulation_fusion, load_quack_gemm()[0], self.pad)
        else:
            out = padded_swiglu_mlp(x, fc1.weight, fc1.bias, fc2.weight, self.pad)
        if fc2.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, group=fc2.tp_group), fc2.bias
        return reduce_from_tensor_model_parallel_region(out, group=fc2.tp_group), fc2.bias


def mlp_summary(module: torch.nn.Module) -> str:
    """The kernels a model part's MLPs run (e.g. "quack (gelu_erf)", "torch (no GPU)", and where megatron-core's
    forward runs them, whether fc1's bias and activation are compiled or on Triton), for the start-up line
    and benchmark records; "none" for a part without our MLPs."""
    def fused(sub) -> str:
        if not sub.fused_bias_activation:
            return ""
        on_kernel = bias_gelu.chosen(sub.config.activation_func) and torch.cuda.is_available()
        how = "GELU on Triton" if on_kernel else "activation compiled"
        return f"; torch's path: fc1 bias and {how}"
    found = [str(sub.epilogue) + fused(sub) for sub in module.modules() if isinstance(sub, EpilogueMLP)]
    return "; ".join(dict.fromkeys(found)) or "none"
