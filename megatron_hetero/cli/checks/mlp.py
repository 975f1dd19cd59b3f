"""Are the MLP's fused GEMMs (the activation in quack's epilogues) right on this GPU at the workloads'
shapes, and faster than cuBLAS plus torch's activation?

    megatron-hetero kernels check mlp [--quick] [--record] [--out DIR]   (one GPU, quack importable: the fa4 extra)

Per case (tokens, hidden, ffn, fc1 bias or not, activation, SwiGLU's among them; bf16 as the models train): the
output, the input gradient and every weight / bias gradient of our fused path (models/mlp_kernels.py
`epilogue_mlp`, weight gradients accumulated into fp32 main_grad as megatron's gradient-accumulation fusion does
in training) and of torch's bf16 path (x @ w1^T + b1, the activation, @ w2^T: what megatron-core's MLP runs)
against fp32 autograd of the same inputs, as max |diff| / max |ref|; then both paths' forward and
forward+backward ms (CUDA events, calls back to back) and the GPU's work alone (common.gpu_ms). A fused error
above TOLERANCE: FAIL, exit 1. Records (one JSON object per line) go to DIR/mlp_check.jsonl; DIR defaults to
$OUT or out/. The policy's auto runs a gated MLP with fc1 biases (Qwen2.5-VL's ViT) on quack's epilogues only on
GPU models where this check passed: --record adds this one to the user's table.
"""

from typing import Callable, NamedTuple

import torch

from megatron_hetero.cli.checks.common import KernelCheck, measure_paths, run_table
from megatron_hetero.models.kernel_policy import GATED_BIAS_MLP_CHECKED, MLP_KERNEL_ENV, record_check
from megatron_hetero.models.mlp import gated_ffn_padding
from megatron_hetero.models.mlp_kernels import ACTIVATIONS, GATED, epilogue_mlp, load_quack_gemm
from megatron_hetero.patches import grad_accum_fusion

TOLERANCE = 0.02  # torch's own bf16 MLP is ~0.005-0.01 off fp32 (bf16 rounding of activations and grads)
DEVICE = "cuda"  # tests/test_mlp_kernels.py runs the measuring on CPU with a stand-in kernel
GRADS = ("out", "dx", "dw1", "db1", "dw2")


class Case(NamedTuple):
    name: str
    tokens: int
    hidden: int
    ffn: int
    bias: bool
    activation: str = "gelu_erf"


def cases(quick: bool) -> list[Case]:
    """The dense MLPs of the workloads at one micro batch's tokens (2 samples; W1's ViT: 32 images of
    729 patches): W1/W3's LLM (no biases), SigLIP's ViT (W1, biased), InternViT-6B's (W4), Qwen3-VL's
    ViT (tanh GELU); the families' SwiGLU LLMs (no biases) at 16,384 tokens; Qwen2.5-VL's ViT (SwiGLU
    with biases, its ffn of 3,420 zero-padded to 3,424) at one bench sample's 26,144 patches."""
    cut = 8 if quick else 1
    return [Case("W1/W3 LLM 4096 -> 16384", 32768 // cut, 4096, 16384, False),
            Case("W1 SigLIP ViT 1152 -> 4304", 23328 // cut, 1152, 4304, True),
            Case("W4 InternViT-6B 3200 -> 12800", 16384 // cut, 3200, 12800, True),
            Case("Qwen3-VL ViT 1152 -> 4304 (tanh)", 16384 // cut, 1152, 4304, True, "gelu_tanh_approx"),
            Case("Qwen2.5-VL-7B LLM 3584 -> 2 x 18944 (SwiGLU)", 16384 // cut, 3584, 18944, False, "swiglu"),
            Case("Qwen3-VL-8B LLM 4096 -> 2 x 12288 (SwiGLU)", 16384 // cut, 4096, 12288, False, "swiglu"),
            Case("Qwen2.5-VL ViT 1280 -> 2 x 3420 (SwiGLU, biases, padded)", 26144 // cut, 1280, 3420, True,
                 "swiglu")]


def inputs(case: Case, seed: int = 0) -> list[torch.Tensor | None]:
    """x, w1, b1 (None without bias), w2, dout: weights at 1 / sqrt(fan-in), as trained layers are; a
    gated unit's fc1 [gate; up] of ffn rows each."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(*shape, device=DEVICE, generator=g) * scale

    rows = 2 * case.ffn if case.activation in GATED else case.ffn
    return [randn(case.tokens, case.hidden), randn(rows, case.hidden, scale=case.hidden**-0.5),
            randn(rows, scale=0.1) if case.bias else None, randn(case.hidden, case.ffn, scale=case.ffn**-0.5),
            randn(case.tokens, case.hidden)]


def torch_mlp(case: Case, x, w1, b1, w2):
    preact = x @ w1.t() if b1 is None else x @ w1.t() + b1
    return ACTIVATIONS[case.activation](preact) @ w2.t()


def fused_mlp(case: Case, x, w1, b1, w2):
    """epilogue_mlp with the weight gradients accumulated into each weight's fp32 main_grad; a gated
    unit's unaligned ffn zero-padded as the model's MLP pads it (mlp.gated_ffn_padding)."""
    pad = gated_ffn_padding(case.ffn) if case.activation in GATED else 0
    return epilogue_mlp(x, w1, b1, w2, case.activation, True, load_quack_gemm()[0], pad)


def _grads(mlp, case: Case, dtype, main_grads: bool) -> list[torch.Tensor]:
    """mlp's output and gradients (x, w1, b1, w2) in fp32, inputs cast to dtype."""
    x, w1, b1, w2, dout = inputs(case)
    leaves = [t.to(dtype).requires_grad_() if t is not None else None for t in (x, w1, b1, w2)]
    for weight in (leaves[1], leaves[3]):
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32) if main_grads else None
    out = mlp(case, *leaves)
    out.backward(dout.to(dtype))
    x, w1, b1, w2 = leaves

    def weight_grad(w):  # as megatron's DDP takes it: main_grad, plus .grad where a path left one
        return w.grad if not main_grads else w.main_grad if w.grad is None else w.main_grad + w.grad

    grads = [x.grad, weight_grad(w1), b1.grad if b1 is not None else None, weight_grad(w2)]
    return [out.detach().float(), *(g.float() if g is not None else None for g in grads)]


def errors(mlp, case: Case) -> dict[str, float]:
    """Max |diff| / max |ref| of out, dx, dw1, (db1,) dw2 of mlp at bf16 against fp32 torch (the fused
    path's weight gradients accumulated into main_grad, as in training)."""
    reference = _grads(torch_mlp, case, torch.float32, False)
    got = _grads(mlp, case, torch.bfloat16, mlp is fused_mlp)
    return {name: float((a - r).abs().max() / r.abs().max())
            for name, a, r in zip(GRADS, got, reference) if r is not None}


def calls(mlp, case: Case) -> tuple[Callable, Callable]:
    """A forward call and a forward and backward call of mlp at bf16, to be timed (the weight gradients
    into fp32 main_grad for both paths)."""
    x, w1, b1, w2, dout = (t.bfloat16().requires_grad_() if t is not None else None for t in inputs(case))
    for weight in (w1, w2):
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
    return lambda: mlp(case, x, w1, b1, w2), lambda: mlp(case, x, w1, b1, w2).backward(dout)


def measure(case: Case, iters: int) -> dict:
    """Both paths' errors and times; ok: the fused path's errors within TOLERANCE."""
    record = dict(case=case.name, tokens=case.tokens, hidden=case.hidden, ffn=case.ffn, bias=case.bias,
                  activation=case.activation)
    return measure_paths(record, case, {"torch": torch_mlp, "quack": fused_mlp}, errors, calls, iters, "quack",
                         TOLERANCE)


def main(quick: bool, out: str, record: bool = False) -> int:
    """The table, PASS or FAIL; with `record`, a pass writes this GPU model into the user's table of GPUs
    where a gated MLP with fc1 biases (Qwen2.5-VL's ViT, among the cases) runs on quack's epilogues."""
    grad_accum_fusion.apply()  # main_grad accumulation without apex, as in training
    status = run_table(KernelCheck(lambda: load_quack_gemm()[1], cases, measure, "tokens",
                                  "torch bf16 err (out / dx / dw1 / [db1 /] dw2) | quack err", "mlp_check.jsonl",
                                  f"the fused path above {TOLERANCE} of fp32", f"{MLP_KERNEL_ENV}=torch"), quick, out)
    if status != 0:
        return status
    name = torch.cuda.get_device_name()
    if record:
        print(f"recorded {name} in {record_check(name, gated_bias_mlp=True)}: the kernel policy's auto runs gated "
              "MLPs with fc1 biases on quack's epilogues there")
    elif name not in GATED_BIAS_MLP_CHECKED:
        print(f"to run gated MLPs with fc1 biases on quack's epilogues on {name}: run again with --record, or "
              f"export {MLP_KERNEL_ENV}=quack")
    return status
