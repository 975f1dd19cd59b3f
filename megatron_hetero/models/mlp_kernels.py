"""The MLP's activation inside its GEMMs (quack-kernels' epilogues), where megatron-core's MLP runs
fc1's GEMM, the activation and fc2's GEMM as separate passes over [tokens, ffn].

Why: without Transformer Engine, GELU is an elementwise kernel reading and writing the widest tensor
of the layer, forward and backward: in W3's profiled step on one H200 (8 LLM layers, global batch 16;
docs/runs/benchmarks.md) 94.6 ms forward and 71.8 ms backward of 6,106. quack's GEMMs apply it in their
epilogue, on the accumulator in registers: fc1's GEMM writes the pre-activation and the activation
(1.07x fc1 + GELU at W1's LLM shape), and fc2's input-gradient GEMM multiplies by the activation's
derivative and writes the activation again, recomputed from the pre-activation, which fc2's weight
gradient needs (1.15x). So the activation is not kept for the backward: one [tokens, ffn] tensor
less per layer than megatron's MLP keeps.

Where: dense MLPs whose activation quack computes exactly as megatron-core would (ACTIVATIONS:
F.gelu, erf; with --bias-gelu-fusion megatron's bias_gelu_impl, the tanh approximation; SwiGLU, the
gated unit of the Qwen and InternVL families' LLMs, at 1.06-1.20x forward and 1.53-1.65x for the
input gradient's GEMM with the gate's derivative by tools/gpu_fusion_probe.py --swiglu), in bf16 /
fp16, on GPUs quack targets, for calls of MLP_MIN_MACS (spec/sizes.py) or more (quack_kernels.py's rule;
MEGATRON_HETERO_MLP_KERNEL=torch pins it off, =quack on for every call); each activation's outputs
and gradients passed `megatron-hetero kernels check mlp` on an H200 before auto ran it; a gated unit with
fc1 biases (Qwen2.5-VL's ViT) only on GPU models where that check passed (kernel_policy's
GATED_BIAS_MLP_CHECKED: the shipped table and the user's, `--record`). The other GEMMs (fc2
forward, fc1's input gradient, both weight gradients) stay torch's (cuBLAS, at the same speed as
quack's plain GEMM by tools/gpu_fusion_probe.py); the weight gradients go into main_grad inside the
GEMM where megatron's gradient-accumulation fusion is on, as megatron-core's linear layers do.
`megatron-hetero kernels check mlp` checks the outputs and gradients against fp32 on a GPU.
"""

import functools
import os
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
from megatron.core.tensor_parallel import layers as tp_layers

from megatron_hetero.models.accelerators import has_triton
from megatron_hetero.models.attention_kernels import import_failure
from megatron_hetero.models.kernel_policy import MLP_KERNEL_ENV, KernelPolicy
from megatron_hetero.models.quack_kernels import QuackChoice, quack_kernel_for
from megatron_hetero.spec.sizes import MLP_MIN_MACS


def _swiglu(preact: torch.Tensor) -> torch.Tensor:
    """megatron-core's gated unit on fc1's output as it lays it out: [gate; up] halves, silu(gate) * up."""
    gate, up = preact.chunk(2, dim=-1)
    return F.silu(gate) * up


# quack's activation name -> torch's same function on megatron-core's layout of fc1's output: what
# megatron-core's MLP computes without the fusion.
ACTIVATIONS: dict[str, Callable] = {
    "gelu_erf": F.gelu,
    "gelu_tanh_approx": functools.partial(F.gelu, approximate="tanh"),
    "swiglu": _swiglu,
}
# Gated units: fc1's weight is [gate; up] (megatron-core's layout, kept); quack's GEMM reads it so
# (concat_layout), or a padded copy laid out interleaved (padded_fc1), and writes the pre-activation
# interleaved, [g0, u0, g1, u1, ...], so that its epilogue pairs each gate with its up; torch sees it
# through halves().
GATED = ("swiglu",)
EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)
HAVE_TRITON = has_triton()


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _halves_kernel(pairs, out, n, BLOCK: tl.constexpr):
        """Row r's n pairs, each one 32-bit word (a 16-bit gate in its low half, its up in the high:
        little-endian), to the row's n gates then its n ups."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        word = tl.load(pairs + row * n + cols, mask=mask)
        tl.store(out + row * 2 * n + cols, word.to(tl.int16), mask=mask)
        tl.store(out + row * 2 * n + n + cols, (word >> 16).to(tl.int16), mask=mask)


PAIRS_BLOCK = 1024  # (gate, up) pairs per program of the kernel above


def halves(interleaved: torch.Tensor) -> torch.Tensor:
    """A gated pre-activation (or its gradient) from quack's interleaved layout to [gate; up] halves.
    On a GPU with Triton, 16-bit values in one pass of whole 32-bit (gate, up) pairs: torch's copy of
    the strided view reads 16-bit values two apart (on one H200 0.81 ms for a [8192, 37888] bf16 gradient
    of Qwen2.5-VL-7B's MLP, where moving its 1.24 GB needs about 0.3)."""
    if HAVE_TRITON and interleaved.is_cuda and pairs_as_words(interleaved):
        return halves_by_words(interleaved)
    return strided_halves(interleaved)


def strided_halves(interleaved: torch.Tensor) -> torch.Tensor:
    """halves() as torch's copy of the strided view (any device, dtype and layout)."""
    return interleaved.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def pairs_as_words(interleaved: torch.Tensor) -> bool:
    """Whether halves_by_words takes the tensor: 16-bit values, contiguous, its pairs 4-byte aligned."""
    return (interleaved.element_size() == 2 and interleaved.is_contiguous() and interleaved.data_ptr() % 4 == 0
            and interleaved.shape[-1] >= 2)


def halves_by_words(interleaved: torch.Tensor) -> torch.Tensor:
    """halves() in one Triton kernel (pairs_as_words' tensors)."""
    n = interleaved.shape[-1] // 2
    out = torch.empty_like(interleaved)
    rows = interleaved.numel() // (2 * n)
    _halves_kernel[(rows, triton.cdiv(n, PAIRS_BLOCK))](interleaved.view(torch.int32), out.view(torch.int16), n,
                                                          BLOCK=PAIRS_BLOCK)
    return out


def quack_activation(config) -> str | None:
    """quack's name for the activation of megatron-core's dense MLP under `config` (a
    TransformerConfig), or None where the fused GEMMs do not compute it (other functions, gated units
    other than plain SwiGLU, Transformer Engine's activation modules)."""
    function = config.activation_func
    if config.use_te_activation_func:
        return None
    if config.gated_linear_unit:
        plain = config.activation_func_clamp_value is None and config.glu_linear_offset == 0
        return "swiglu" if function is F.silu and plain else None
    if (isinstance(function, functools.partial) and function.func is F.gelu and not function.args
            and function.keywords == {"approximate": "tanh"}):  # Hugging Face's gelu_pytorch_tanh (models/vlm.py)
        return "gelu_tanh_approx"
    if function is not F.gelu:
        return None
    # megatron-core's MLP fuses the bias with the tanh-approximated GELU (bias_gelu_impl) under this flag.
    return "gelu_tanh_approx" if config.bias_activation_fusion else "gelu_erf"


class QuackGemm(NamedTuple):
    """quack's GEMMs with an activation epilogue (quack.gemm_interface): act(A, B, bias=, activation=,
    tuned=) -> (preact, postact); dact(A, B, preact, activation=, tuned=) -> (dpreact, postact)."""

    act: Callable
    dact: Callable


def _dsl_location_problem(dsl_file: str) -> str | None:
    """quack keys an epilogue's compiled kernel by walking its functions' globals and stops at installed
    code, which it knows by a site-packages or dist-packages directory in the file's path; the CuTe DSL
    installed elsewhere (pip --target DIR) leads the walk into the DSL's runtime state, and every
    epilogue GEMM refuses to compile (TypeError: ... no fail-closed semantic key)."""
    parts = dsl_file.split(os.sep)
    if "site-packages" in parts or "dist-packages" in parts:
        return None
    return (f"quack's epilogue GEMMs need nvidia-cutlass-dsl installed under a site-packages directory, "
            f"not {os.path.dirname(os.path.dirname(dsl_file))}")


@functools.cache
def load_quack_gemm() -> tuple[QuackGemm | None, str | None]:
    """(quack's epilogue GEMMs, None), or (None, why they cannot run here)."""
    try:
        import cutlass
        from quack.gemm_interface import gemm_act, gemm_dact
    except Exception as error:  # ImportError, or the CuTe DSL failing to load its libraries
        return None, import_failure("quack", error)
    problem = _dsl_location_problem(cutlass.__file__)
    return (None, problem) if problem else (QuackGemm(gemm_act, gemm_dact), None)


def mlp_kernel_for(policy: KernelPolicy) -> QuackChoice:
    """The kernel of MLPs under `policy` (its MLP mode) on this process's GPU."""
    return quack_kernel_for(MLP_KERNEL_ENV, policy.mlp, load_quack_gemm, MLP_MIN_MACS)


def weight_grad(weight: torch.Tensor, total_input: torch.Tensor, grad_output: torch.Tensor,
                accumulation_fusion: bool) -> torch.Tensor | None:
    """grad_output^T @ total_input, the weight gradient of a linear layer as megatron-core's linear
    layers return it: under gradient-accumulation fusion added to weight.main_grad inside the GEMM
    (megatron's fused_weight_gradient_mlp_cuda; apex's, or the plugin's on torch's GEMM) and a
    placeholder returned where megatron's DDP expects one (grad_added_to_main_grad)."""
    if not accumulation_fusion:
        return grad_output.t().matmul(total_input)
    main_grad = weight.main_grad
    kernels = tp_layers.fused_weight_gradient_mlp_cuda
    accumulate = kernels.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32 else kernels.wgrad_gemm_accum_fp16
    accumulate(total_input, grad_output, main_grad)
    return main_grad_placeholder(weight, total_input.dtype, total_input.device)


def cut_weight_grad(weight: torch.Tensor, total_input: torch.Tensor, grad_output: torch.Tensor, blocks: int,
                    accumulation_fusion: bool, interleaved: bool = False) -> torch.Tensor | None:
    """weight_grad at the weight's shape [rows, cols] where it may have run zero-padded (the operands wider
    than the weight: padded_fc1, fc2's pad): the GEMM at the padded shape (at the unaligned one cuBLAS
    takes its slow 2-element-aligned kernels), then the padded rows of each of `blocks` blocks (fc1's gate
    and up, `interleaved` as padded_fc1 lays them out) and the padded columns (fc2's) dropped through a
    view (cut_rows): under gradient-accumulation fusion added to main_grad in that one pass."""
    rows, cols = weight.shape
    if not interleaved and (grad_output.shape[1], total_input.shape[1]) == (rows, cols):
        return weight_grad(weight, total_input, grad_output, accumulation_fusion)
    cut = cut_rows(grad_output.t().matmul(total_input), rows, blocks, interleaved)[..., :cols]
    if not accumulation_fusion:
        return cut.reshape(rows, cols)
    weight.main_grad.view(blocks, rows // blocks, cols).add_(cut)
    return main_grad_placeholder(weight, total_input.dtype, total_input.device)


def cut_rows(padded: torch.Tensor, rows: int, blocks: int, interleaved: bool) -> torch.Tensor:
    """A view [blocks, rows // blocks, ...] of the first rows // blocks of each of `blocks` blocks of
    `padded`'s rows: blocks one after another ([gate; up]), or `interleaved` row by row ([g0, u0, g1, ...])."""
    if interleaved:
        return padded.unflatten(0, (-1, blocks)).transpose(0, 1)[:, :rows // blocks]
    return padded.unflatten(0, (blocks, -1))[:, :rows // blocks]


def main_grad_placeholder(weight: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """What a linear layer returns as `weight`'s gradient once it has added it to weight.main_grad
    itself: a placeholder where megatron's DDP expects one (grad_added_to_main_grad), else None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    # A placeholder keeps DDP's hooks on the main backward thread (megatron-core's linear layers do the same).
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=dtype, device=device)


class _LinearAct(torch.autograd.Function):
    """fc1 with the activation in its GEMM's epilogue, on 2-D x [tokens, in].

    forward: preact = x @ w^T (+ b), act = activation(preact), one GEMM writing both; act is not
    differentiable (its gradient comes back as preact's, from _DActLinear's backward); a gated
    unit's preact interleaved (GATED); `padded`: the weight and bias zero-padded and, for a gated unit,
    their rows interleaved as the preact (padded_fc1), which the GEMMs run instead;
    backward: dx = dpreact @ w, dw = dpreact^T @ x, db = sum of dpreact over tokens, dw and db at the
    parameters' shapes; a gated unit's dpreact against its [gate; up] weight first back in halves (one
    copy of it, so that both GEMMs stay cuBLAS's and dw goes into main_grad inside its GEMM), against
    padded_fc1's interleaved weight as it is (dw and db cut out of the interleaved rows)."""

    @staticmethod
    def forward(ctx, x, weight, bias, padded, activation, accumulation_fusion, gemm):
        run_weight, run_bias = padded or (weight, bias)
        gated = activation in GATED
        interleaved = gated and padded is not None  # padded_fc1's layout
        # A [gate; up] weight is read so by quack's GEMM (concat_layout), its fc1 bias too ("bias").
        layout = {"concat_layout": ("B",) if bias is None else ("B", "bias")} if gated and not interleaved else {}
        preact, act = gemm.act(x, run_weight.t(), bias=run_bias, activation=activation, tuned=False, **layout)
        ctx.save_for_backward(x, weight, run_weight)
        ctx.has_bias, ctx.accumulation_fusion = bias is not None, accumulation_fusion
        ctx.gated, ctx.interleaved = gated, interleaved
        ctx.mark_non_differentiable(act)
        ctx.set_materialize_grads(False)
        return preact, act

    @staticmethod
    def backward(ctx, dpreact, _):
        x, weight, run_weight = ctx.saved_tensors
        if ctx.gated and not ctx.interleaved:  # [gate; up] as the weight's rows
            dpreact = halves(dpreact)
        dx = dpreact.matmul(run_weight) if ctx.needs_input_grad[0] else None
        blocks = 2 if ctx.gated else 1
        dw = None
        if ctx.needs_input_grad[1]:
            dw = cut_weight_grad(weight, x, dpreact, blocks, ctx.accumulation_fusion, ctx.interleaved)
        db = None
        if ctx.has_bias and ctx.needs_input_grad[2]:  # the padded rows' sums dropped, as the weight's
            db = cut_rows(dpreact.sum(0), weight.shape[0], blocks, ctx.interleaved).reshape(-1)
        return dx, dw, db, None, None, None, None


class _DActLinear(torch.autograd.Function):
    """fc2 whose input-gradient GEMM applies the activation's derivative in its epilogue.

    forward: out = act @ w^T, with `padded` (the weight's ffn columns zero-padded) for w where given;
    preact is kept for the backward, act is not;
    backward: one GEMM gives dpreact = (dout @ w) * activation'(preact) and act again, recomputed
    from preact, for dw = dout^T @ act (torch's activation recomputes it where dpreact is not needed),
    dw at the parameter's shape."""

    @staticmethod
    def forward(ctx, preact, act, weight, padded, activation, accumulation_fusion, gemm):
        run_weight = weight if padded is None else padded
        ctx.save_for_backward(preact, weight, run_weight)
        ctx.activation, ctx.accumulation_fusion, ctx.gemm = activation, accumulation_fusion, gemm
        return act.matmul(run_weight.t())

    @staticmethod
    def backward(ctx, dout):
        preact, weight, run_weight = ctx.saved_tensors
        dout = dout.contiguous()
        if ctx.needs_input_grad[0]:
            dpreact, act = ctx.gemm.dact(dout, run_weight, preact, activation=ctx.activation, tuned=False)
        else:
            dpreact, act = None, ACTIVATIONS[ctx.activation](halves(preact) if ctx.activation in GATED else preact)
        dw = cut_weight_grad(weight, act, dout, 1, ctx.accumulation_fusion) if ctx.needs_input_grad[2] else None
        return dpreact, None, dw, None, None, None, None


def epilogue_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None,
                 fc2_weight: torch.Tensor, activation: str, accumulation_fusion: bool,
                 gemm: QuackGemm, pad: int = 0) -> torch.Tensor:
    """fc2(activation(fc1(x))) of one TP rank's weights (fc1 [ffn, in], fc2 [out, ffn]), fc2's bias
    left to the caller, on x of any leading shape; the activation in the GEMMs' epilogues; a gated
    unit's ffn zero-padded by `pad` (quack's GEMMs take 16-byte-aligned rows only): the GEMMs run on
    padded copies made outside autograd (padded_fc1, fc2's columns), the weight gradients come back at
    the parameters' shapes (cut_weight_grad), into main_grad under gradient-accumulation fusion as
    without padding."""
    fc1_padded = fc2_padded = None
    if pad:
        with torch.no_grad():
            fc1_padded, fc2_padded = padded_fc1(fc1_weight, fc1_bias, pad), F.pad(fc2_weight, (0, pad))
    flat = x.reshape(-1, x.shape[-1])
    preact, act = _LinearAct.apply(flat.contiguous(), fc1_weight, fc1_bias, fc1_padded, activation,
                                   accumulation_fusion, gemm)
    out = _DActLinear.apply(preact, act, fc2_weight, fc2_padded, activation, accumulation_fusion, gemm)
    return out.view(*x.shape[:-1], out.shape[-1])


def padded_fc1(fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, pad: int
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A gated fc1's weight [2 ffn, in] and bias as [gate; up], zero-padded by `pad` rows after each of
    gate and up, in quack's interleaved layout ([g0, u0, g1, u1, ...]): in one copy, as the pad itself
    takes, so that quack's GEMM reads it without its concat layout and fc1's backward takes the
    pre-activation's gradient as quack writes it, interleaved, without the halves() copy of it."""
    ffn = fc1_weight.shape[0] // 2

    def interleaved(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros(ffn + pad, 2, *t.shape[1:])
        out[:ffn].copy_(t.unflatten(0, (2, ffn)).transpose(0, 1))
        return out.flatten(0, 1)

    return interleaved(fc1_weight), None if fc1_bias is None else interleaved(fc1_bias)


def pad_ffn(fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None, fc2_weight: torch.Tensor, pad: int
            ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A gated MLP's weights (fc1 [2 ffn, in] as [gate; up], its bias, fc2 [out, ffn]) with `pad` zero
    rows after each of gate and up and as many zero columns in fc2: the same function, whose padded
    activations and weight gradients are zero (the pads' backward slices them off)."""
    ffn = fc2_weight.shape[1]
    w1 = F.pad(fc1_weight.unflatten(0, (2, ffn)), (0, 0, 0, pad)).flatten(0, 1)
    b1 = None if fc1_bias is None else F.pad(fc1_bias.unflatten(0, (2, ffn)), (0, pad)).flatten()
    return w1, b1, F.pad(fc2_weight, (0, pad))


def padded_swiglu_mlp(x: torch.Tensor, fc1_weight: torch.Tensor, fc1_bias: torch.Tensor | None,
                      fc2_weight: torch.Tensor, pad: int) -> torch.Tensor:
    """fc2(swiglu(fc1(x))) of one TP rank's weights (fc1 [2 ffn, in] as [gate; up], fc2 [out, ffn]), fc2's
    bias left to the caller, with the ffn zero-padded by `pad` columns in every GEMM: where 2-byte rows of
    ffn elements are not 16-byte aligned cuBLAS takes its 2-element-aligned sm80 kernels (Qwen2.5-VL's
    ViT, ffn 3,420: ~200 TFLOPS on an H200 against ~730 at 3,424). Exact: the padded gate and up rows are
    zero, so are their activations and the gradients of every padded weight (sliced off by the pads'
    backward); fc1's bias in its GEMM, the SwiGLU one fused kernel each way (megatron-core's)."""
    w1, b1, w2 = pad_ffn(fc1_weight, fc1_bias, fc2_weight, pad)
    act = bias_swiglu_impl(F.linear(x.reshape(-1, x.shape[-1]), w1, b1), None)
    out = F.linear(act, w2)
    return out.view(*x.shape[:-1], out.shape[-1])
