"""The norm calls quack does not take on our Triton kernels (models/small_norm.py): on Triton's CPU
interpreter against torch's norms in fp64 and through our norm module against its torch path, compiled for
Hopper, on a GPU against torch's kernels; which calls take them under which mode."""

import pytest
import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models import norm as norm_module
from megatron_hetero.models import small_norm
from megatron_hetero.models.kernel_policy import SMALL_NORM_ENV, KernelPolicyError, build
from megatron_hetero.models.quack_kernels import QUACK, QuackChoice
from tests.hopper import hopper_cubin
from tests.interpreter import run_on_interpreter


def test_kernels_match_torchs_norms_within_rounding():
    results = run_on_interpreter("small_norm_script")
    assert len(results) == 56 and all(all(checks) for checks in results.values()), results


def test_kernels_compile_for_hopper():
    """Both kernels compile to sm90 code, RMSNorm and LayerNorm, with and without bias and residual (Triton's
    own ptxas, no GPU needed)."""
    for rms, has_bias, residual in ((True, False, True), (False, True, False)):
        flags = {"BLOCK": 2048, "RMS": rms, "HAS_BIAS": has_bias}
        assert hopper_cubin(small_norm._norm_kernel, {
            "x": "*bf16", "weight": "*bf16", "bias": "*bf16", "out": "*bf16", "rstd": "*fp32", "mean": "*fp32",
            "hidden": "i32", "eps": "fp32"}, flags)
        assert hopper_cubin(small_norm._norm_backward_kernel, {
            "x": "*bf16", "weight": "*bf16", "dout": "*bf16", "dresidual": "*bf16", "rstd": "*fp32",
            "mean": "*fp32", "dx": "*bf16", "weight_sums": "*fp32", "bias_sums": "*fp32", "rows": "i32",
            "hidden": "i32"}, {**flags, "ROWS": small_norm.ROWS, "HAS_RESIDUAL": residual})


def test_takes_contiguous_gpu_calls_with_parameters_of_one_dtype(monkeypatch):
    monkeypatch.setattr(small_norm, "HAVE_TRITON", True)
    x = torch.zeros(4, 2, 8)
    cuda = type("Cuda", (), {"is_cuda": True, "shape": x.shape, "is_contiguous": lambda self: True,
                             "numel": lambda self: 64})
    fake, weight = cuda(), torch.ones(8)
    assert small_norm.takes(fake, weight, None) and small_norm.takes(fake, weight, torch.zeros(8))
    assert not small_norm.takes(x, weight, None)  # on the CPU
    assert not small_norm.takes(fake, weight, torch.zeros(8).half())  # a bias of another dtype
    assert not small_norm.takes(fake, torch.ones(4), None)  # not one weight a column
    empty = cuda()
    empty.numel = lambda: 0
    assert not small_norm.takes(empty, weight, None)  # no rows: torch's kernels


def test_a_bad_mode_is_one_line():
    assert build(environ={}).small_norm == "auto"
    assert build(environ={SMALL_NORM_ENV: "triton"}).small_norm == "triton"
    with pytest.raises(KernelPolicyError, match=f"^{SMALL_NORM_ENV}=fused: use one of auto, torch, triton$"):
        build(environ={SMALL_NORM_ENV: "fused"})


@pytest.mark.parametrize("mode", [None, "auto", "torch", "triton"])
@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_the_norm_runs_the_kernels_for_calls_quack_does_not_take_under_triton_only(monkeypatch, mode,
                                                                                  normalization):
    """Under triton a call below quack's minimum runs the kernels (with the module's weight, bias, eps and
    residual hand-back), a call quack takes runs quack; under auto (the default) and torch, torch's norm;
    the summary says which on a GPU."""
    if mode is None:
        monkeypatch.delenv(SMALL_NORM_ENV, raising=False)
    else:
        monkeypatch.setenv(SMALL_NORM_ENV, mode)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, normalization=normalization)
    module = norm_module.SequenceParallelNorm(config, 8, eps=1e-6, has_residual=True)
    module.kernel = QuackChoice(QUACK, min_work=2 * 2 * 8)
    ran = []
    monkeypatch.setattr(small_norm, "takes", lambda *args: True)
    monkeypatch.setattr(small_norm, "small_norm", lambda *args: ran.append(("triton", *args)) or (args[0], args[0]))
    monkeypatch.setattr(norm_module, "quack_norm", lambda *args: ran.append(("quack",)) or (args[0], args[0]))
    x = torch.randn(1, 2, 8)
    out, residual = module(x)
    module(torch.randn(2, 2, 8))  # quack's minimum
    on_triton = mode == "triton"
    assert [r[0] for r in ran] == (["triton", "quack"] if on_triton else ["quack"])
    if on_triton:
        assert ran[0][1:] == (x, module.weight, module.bias, 1e-6, normalization == "RMSNorm", True)
    else:
        want = (F.rms_norm(x, (8,), module.weight, 1e-6) if normalization == "RMSNorm"
                else F.layer_norm(x, (8,), module.weight, module.bias, 1e-6))
        assert torch.equal(out, want) and residual is x
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    said = "; the calls quack does not take on Triton" if on_triton and small_norm.HAVE_TRITON else ""
    assert norm_module.norm_summary(module) == str(module.kernel) + said


@pytest.mark.skipif(not (torch.cuda.is_available() and small_norm.HAVE_TRITON), reason="needs a GPU with Triton")
@pytest.mark.parametrize("rms", [True, False])
def test_on_a_gpu_the_kernels_match_torchs_norms(rms):
    """On a GPU, bf16 at a ViT's width: the output, x's gradient (with the residual's) and the parameters'
    gradients within rounding of torch's kernels."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, dout, dres = (torch.randn(12300, 1, 1280, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    weight = torch.rand(1280, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5
    bias = None if rms else torch.randn(1280, device="cuda", generator=gen, dtype=torch.bfloat16)
    runs = []
    for ours in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x, weight, bias) if t is not None]
        if ours:
            out, kept = small_norm.small_norm(*leaves, *([None] if rms else []), 1e-6, rms, True)
        else:
            out = (F.rms_norm(leaves[0], (1280,), leaves[1], 1e-6) if rms
                   else F.layer_norm(leaves[0], (1280,), leaves[1], leaves[2], 1e-6))
            kept = leaves[0]
        torch.autograd.backward((out, kept), (dout, dres))
        runs.append([out.detach()] + [t.grad for t in leaves])
    for mine, theirs in zip(*runs, strict=True):
        torch.testing.assert_close(mine.float(), theirs.float(), rtol=2**-7, atol=2e-2)
