"""Are quack's norm kernels right on this GPU at the workloads' widths, and faster than torch's?

    megatron-hetero kernels check norms [--quick] [--out DIR]   (one GPU, quack importable: the fa4 extra)

Per case (LayerNorm or RMSNorm, hidden width, rows; bf16 activations and parameters as the models train them):
output, input gradient and weight / bias gradients of our quack path (models/norm_kernels.py `quack_norm`) and
of torch's bf16 kernels (F.layer_norm / F.rms_norm, what the norms ran before) against fp32 autograd of the same
inputs, as max |diff| / max |ref|; then both paths' forward and forward+backward ms (CUDA events, calls back to
back) and the GPU's work alone (common.gpu_ms). A quack error above TOLERANCE: FAIL, exit 1. Records (one JSON
object per line) go to DIR/norm_check.jsonl; DIR defaults to $OUT or out/.
"""

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from megatron_hetero.cli.checks.common import KernelCheck, measure_paths, run_table
from megatron_hetero.models.kernel_policy import NORM_KERNEL_ENV
from megatron_hetero.models.norm_kernels import load_quack, quack_norm

TOLERANCE = 0.02  # torch's own bf16 norms are ~0.004-0.008 off fp32 (bf16 rounding of out and grads)
DEVICE = "cuda"  # tests/test_norm_kernels.py runs the measuring on CPU with a stand-in kernel


class Case(NamedTuple):
    name: str
    rms: bool
    hidden: int
    rows: int


def cases(quick: bool) -> list[Case]:
    """The norms of the workloads, at one micro batch's rows (tokens x 2 samples; W1's ViT: 32 images
    of 729 patches): W1/W3's LLM and SigLIP ViT (LayerNorm), the Qwen families' LLMs and ViTs, InternViT-6B
    and Qwen3's per-head query/key norms (RMSNorm)."""
    cut = 8 if quick else 1
    return [Case("W1 LLM (LayerNorm 4096)", False, 4096, 32768 // cut),
            Case("W1 ViT (LayerNorm 1152)", False, 1152, 23328 // cut),
            Case("Qwen2.5-VL-7B LLM (RMSNorm 3584)", True, 3584, 32768 // cut),
            Case("Qwen3-VL-8B LLM (RMSNorm 4096)", True, 4096, 32768 // cut),
            Case("Qwen2.5-VL ViT (RMSNorm 1280)", True, 1280, 16384 // cut),
            Case("InternViT-6B (RMSNorm 3200)", True, 3200, 8192 // cut),
            Case("Qwen3 query/key norm (RMSNorm 128 per head)", True, 128, 32768 * 32 // cut)]


def inputs(case: Case, seed: int = 0):
    """x (activations with an offset, as a residual stream has), weight near 1, bias near 0, dout."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(case.rows, case.hidden, device=DEVICE, generator=g) * 2 + 0.5
    weight = 1 + 0.1 * torch.randn(case.hidden, device=DEVICE, generator=g)
    bias = None if case.rms else 0.1 * torch.randn(case.hidden, device=DEVICE, generator=g)
    dout = torch.randn(case.rows, case.hidden, device=DEVICE, generator=g)
    return x, weight, bias, dout


def _torch_norm(case: Case, x, weight, bias):
    if case.rms:
        return F.rms_norm(x, (case.hidden,), weight, 1e-6)
    return F.layer_norm(x, (case.hidden,), weight, bias, 1e-6)


def _quack_norm(case: Case, x, weight, bias):
    return quack_norm(x, weight, bias, 1e-6, case.rms, load_quack()[0])


def _grads(norm, case: Case, x, weight, bias, dout, dtype):
    """norm's output and gradients (x, weight, bias) in fp32, inputs cast to dtype."""
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (x, weight, bias)]
    out = norm(case, *leaves)
    out.backward(dout.to(dtype))
    return [out.float(), *(t.grad.float() for t in leaves if t is not None)]


def errors(norm, case: Case) -> dict[str, float]:
    """Max |diff| / max |ref| of out, dx, dw (and db) of norm at bf16 against fp32 torch."""
    x, weight, bias, dout = inputs(case)
    reference = _grads(_torch_norm, case, x, weight, bias, dout, torch.float32)
    got = _grads(norm, case, x, weight, bias, dout, torch.bfloat16)
    names = ["out", "dx", "dw"] + ([] if case.rms else ["db"])
    return {name: float((a - r).abs().max() / r.abs().max()) for name, a, r in zip(names, got, reference)}


def calls(norm, case: Case) -> tuple[Callable, Callable]:
    """A forward call and a forward and backward call of norm at bf16, to be timed."""
    x, weight, bias, dout = (t.bfloat16() if t is not None else None for t in inputs(case))
    leaves = [t.requires_grad_() if t is not None else None for t in (x, weight, bias)]
    return lambda: norm(case, *leaves), lambda: norm(case, *leaves).backward(dout)


def measure(case: Case, iters: int) -> dict:
    """Both paths' errors and times; ok: quack's errors within TOLERANCE."""
    record = dict(case=case.name, rms=case.rms, hidden=case.hidden, rows=case.rows)
    return measure_paths(record, case, {"torch": _torch_norm, "quack": _quack_norm}, errors, calls, iters, "quack",
                         TOLERANCE)


def main(quick: bool, out: str) -> int:
    return run_table(KernelCheck(lambda: load_quack()[1], cases, measure, "rows",
                                "torch bf16 err (out / dx / dw / db) | quack err", "norm_check.jsonl",
                                f"quack above {TOLERANCE} of fp32", f"{NORM_KERNEL_ENV}=torch"), quick, out)
