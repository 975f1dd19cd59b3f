"""Are our Triton kernels for the layers' elementwise work right on this GPU, and faster than what the
layers run without them?

    megatron-hetero kernels check triton [--quick] [--out DIR]   (one GPU, Triton importable)

Per case (the families' shapes at one micro batch, bf16): the output and every input's gradient of our kernel
and of the path it stands in for (the compiled function or torch's kernel that the variable's `torch` mode runs)
against fp32 autograd of that path's function on the same inputs, as max |diff| / max |ref|; then both paths'
forward and forward+backward ms (CUDA events, calls back to back) and the GPU's work alone (common.gpu_ms). The
kernels: the bias and residual add, with InternViT's layer scale too (models/residual_add.py) and an MLP's bias
and erf GELU (bias_gelu.py), which the default (auto) runs; the packed ViTs' attention input
(attention_input.py) and the norms quack does not take (small_norm.py), which run under their variables'
`triton` mode only: the times say whether that pays on this GPU. A Triton error above TOLERANCE: FAIL, exit 1.
Records (one JSON object per line) go to DIR/triton_check.jsonl; DIR defaults to $OUT or out/.
"""

import functools
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

from megatron_hetero.cli.checks.common import KernelCheck, measure_paths, run_table
from megatron_hetero.families.internvl.vision import _scaled_bias_dropout_add_func, _scaled_bias_dropout_add_fused
from megatron_hetero.models import attention_input, bias_gelu, packed_attention, residual_add, small_norm
from megatron_hetero.models.kernel_policy import ATTENTION_INPUT_ENV, BIAS_GELU_ENV, RESIDUAL_ADD_ENV, SMALL_NORM_ENV
from megatron_hetero.models.mlp import _bias_activation, _bias_activation_fused

TOLERANCE = 0.02  # the bf16 paths are ~0.004-0.008 off fp32 by their rounding alone
DEVICE = "cuda"  # tests/test_triton_check.py runs the measuring on CPU under Triton's interpreter
EPS = 1e-6


class Case(NamedTuple):
    """`kind`: one of KINDS; `tokens` rows of width `hidden`; an attention input's `head_dim` and the
    `run_dim` its attention runs at (padded above head_dim)."""

    name: str
    kind: str
    tokens: int
    hidden: int
    head_dim: int = 0
    run_dim: int = 0


def cases(quick: bool) -> list[Case]:
    """The families' calls at one micro batch of the recorded presets (Qwen2.5-VL-7B's ViT at 8 images a
    sample and at 6, its LLM; InternVL3-8B's InternViT-300M, InternViT-6B's widths)."""
    cut = 8 if quick else 1
    return [Case("Qwen2.5-VL ViT add (1280, bias)", "add", 26144 // cut, 1280),
            Case("Qwen2.5-VL-7B LLM add (3584)", "add without bias", 8192 // cut, 3584),
            Case("InternViT-300M layer-scale add (1024)", "layer-scale add", 12300 // cut, 1024),
            Case("InternViT-6B layer-scale add (3200)", "layer-scale add", 8192 // cut, 3200),
            Case("InternViT-300M MLP bias-GELU (4096)", "bias-GELU", 12300 // cut, 4096),
            Case("Qwen2.5-VL ViT attention input (16 x 80 run at 96)", "attention input", 26144 // cut, 1280, 80, 96),
            Case("Qwen2.5-VL ViT attention input (16 x 80)", "attention input", 26144 // cut, 1280, 80, 80),
            Case("Qwen2.5-VL ViT RMSNorm at 6 images (1280)", "RMSNorm", 10528 // cut, 1280),
            Case("Qwen2.5-VL ViT RMSNorm at 8 images (1280)", "RMSNorm", 26144 // cut, 1280),
            Case("InternViT-300M LayerNorm (1024)", "LayerNorm", 12300 // cut, 1024)]


@functools.cache
def _rotary(case: Case, dtype) -> tuple[torch.Tensor, ...]:
    """RoPE tables (cos_q, sin_q, cos_k, sin_k) [tokens, 1, 1, head_dim] of random angles, in `dtype`
    (made once: not part of the timed calls)."""
    g = torch.Generator(device=DEVICE).manual_seed(1)
    angles = torch.rand(2, case.tokens, 1, 1, case.head_dim, device=DEVICE, generator=g) * 6.3
    return tuple(f(a).to(dtype) for a in angles for f in (torch.cos, torch.sin))


def _heads(heads_fn, case: Case, mixed, bias) -> tuple[torch.Tensor, ...]:
    """An attention input's query, key and value heads."""
    return heads_fn(mixed, bias, _rotary(case, mixed.dtype), case.hidden // case.head_dim, 1, case.head_dim,
                    case.run_dim)


def _norm(case: Case, x, weight, bias=None):
    if case.kind == "RMSNorm":
        return F.rms_norm(x, (case.hidden,), weight, EPS)
    return F.layer_norm(x, (case.hidden,), weight, bias, EPS)


class Kind(NamedTuple):
    """A kernel's inputs (names; 'scale' and 'weight' near 1, 'bias' small, the rest N(0, 1)), the
    variable choosing it, and three functions of (case, *inputs) -> a tensor or a tuple of them: our
    kernel, the path it stands in for (as GPUs run it), and that path's function as eager torch (run in
    fp32 for the reference)."""

    inputs: tuple[str, ...]
    env: str
    triton: Callable
    torch: Callable
    eager: Callable


KINDS = {
    "add": Kind(("x", "bias", "residual"), RESIDUAL_ADD_ENV,
                lambda c, x, b, r: residual_add.residual_add(x, b, r),
                lambda c, x, b, r: bias_dropout_add_fused_train((x, b), r, 0.0),
                lambda c, x, b, r: r + (x + b)),
    "add without bias": Kind(("x", "residual"), RESIDUAL_ADD_ENV,
                             lambda c, x, r: residual_add.residual_add(x, None, r),
                             lambda c, x, r: bias_dropout_add_fused_train((x, None), r, 0.0),
                             lambda c, x, r: r + x),
    "layer-scale add": Kind(("x", "bias", "residual", "scale"), RESIDUAL_ADD_ENV,
                            lambda c, x, b, r, s: residual_add.residual_add(x, b, r, s),
                            lambda c, x, b, r, s: _scaled_bias_dropout_add_fused(x, b, r, s, 0.0, True),
                            lambda c, x, b, r, s: _scaled_bias_dropout_add_func(x, b, r, s, 0.0, True)),
    "bias-GELU": Kind(("x", "bias"), BIAS_GELU_ENV,
                      lambda c, x, b: bias_gelu.bias_gelu(x, b),
                      lambda c, x, b: _bias_activation_fused(x, b, F.gelu),
                      lambda c, x, b: _bias_activation(x, b, F.gelu)),
    "attention input": Kind(("mixed", "bias"), ATTENTION_INPUT_ENV,
                            lambda c, m, b: _heads(attention_input.packed_heads, c, m, b),
                            lambda c, m, b: _heads(packed_attention.torch_heads, c, m, b),
                            lambda c, m, b: _heads(packed_attention.packed_heads, c, m, b)),
    "RMSNorm": Kind(("x", "weight"), SMALL_NORM_ENV,
                    lambda c, x, w: small_norm.small_norm(x, w, None, EPS, True), _norm, _norm),
    "LayerNorm": Kind(("x", "weight", "bias"), SMALL_NORM_ENV,
                      lambda c, x, w, b: small_norm.small_norm(x, w, b, EPS, False), _norm, _norm),
}


def inputs(case: Case, seed: int = 0) -> list[torch.Tensor]:
    """The case's inputs in fp32: activations [tokens, 1, width], per-column parameters [width]."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    width = 3 * case.hidden if case.kind == "attention input" else case.hidden
    shapes = {"x": (case.tokens, 1, width), "residual": (case.tokens, 1, width), "mixed": (case.tokens, 1, width)}
    made = []
    for name in KINDS[case.kind].inputs:
        t = torch.randn(shapes.get(name, (width,)), device=DEVICE, generator=g)
        made.append(1 + 0.1 * t if name in ("scale", "weight") else 0.1 * t if name == "bias" else t)
    return made


def _one(out) -> torch.Tensor:
    """A path's output; several (the attention input's heads) flattened into one."""
    return torch.cat([t.flatten() for t in out]) if isinstance(out, tuple) else out


def _outputs_and_grads(path, case: Case, leaves, dtype) -> list[torch.Tensor]:
    """path's output and every input's gradient in fp32, the inputs cast to dtype, for a fixed random
    gradient of the output."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in leaves]
    out = _one(path(case, *leaves))
    g = torch.Generator(device=DEVICE).manual_seed(2)
    out.backward(torch.randn(out.shape, device=DEVICE, generator=g).to(dtype))
    return [out.float()] + [t.grad.float() for t in leaves]


def errors(path, case: Case) -> dict[str, float]:
    """Max |diff| / max |ref| of the output and each input's gradient of path in bf16 against the eager
    function in fp32."""
    kind, leaves = KINDS[case.kind], inputs(case)
    reference = _outputs_and_grads(kind.eager, case, leaves, torch.float32)
    got = _outputs_and_grads(path, case, leaves, torch.bfloat16)
    names = ["out"] + [f"d{name}" for name in kind.inputs]
    return {name: float((a - r).abs().max() / r.abs().max()) for name, a, r in zip(names, got, reference)}


def calls(path, case: Case) -> tuple[Callable, Callable]:
    """A forward call and a forward and backward call of path in bf16, to be timed."""
    leaves = [t.bfloat16().requires_grad_() for t in inputs(case)]
    douts = [t.detach().clone().normal_() for t in torch.utils._pytree.tree_leaves(path(case, *leaves))]
    return lambda: path(case, *leaves), lambda: torch.autograd.backward(path(case, *leaves), douts)


def measure(case: Case, iters: int) -> dict:
    """Both paths' errors and times; ok: the Triton kernel's errors within TOLERANCE."""
    kind = KINDS[case.kind]
    record = dict(case=case.name, kind=case.kind, tokens=case.tokens, hidden=case.hidden, env=kind.env)
    return measure_paths(record, case, {"torch": kind.torch, "triton": kind.triton}, errors, calls, iters, "triton",
                         TOLERANCE)


def _problem() -> str | None:
    return None if residual_add.HAVE_TRITON else "Triton does not import here: the layers run torch's paths"


def main(quick: bool, out: str) -> int:
    return run_table(KernelCheck(
        _problem, cases, measure, "tokens", "torch err (out / d inputs) | triton err", "triton_check.jsonl",
        f"a Triton kernel above {TOLERANCE} of fp32", f"{RESIDUAL_ADD_ENV}=torch {BIAS_GELU_ENV}=torch",
        passed="our Triton kernels are right here (auto runs the adds and the bias-GELU on them; "
               f"{ATTENTION_INPUT_ENV}=triton and {SMALL_NORM_ENV}=triton the rest, where the "
               "times above say it pays)", judged="triton"), quick, out)
