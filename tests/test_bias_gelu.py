"""fc1's bias add and erf GELU on our Triton kernels (models/bias_gelu.py): on Triton's CPU interpreter
against torch's GELU in fp64, compiled for Hopper, and on a GPU against the compiled function; which
calls take them under which mode; the MLP calls them."""

import types

import pytest
import torch
import torch.nn.functional as F

from megatron_hetero.models import bias_gelu, column_sums
from megatron_hetero.models.kernel_policy import BIAS_GELU_ENV, KernelPolicyError, build
from tests.compiling import outputs_and_gradients
from tests.hopper import hopper_cubin
from tests.interpreter import run_on_interpreter


def test_kernels_match_torch_gelu_within_rounding():
    """On Triton's CPU interpreter (tests/bias_gelu_script.py, a process of its own: the interpreter must
    be on before Triton is imported): bf16, fp16 and fp32, a masked last block, rows of one element,
    backward tiles masked and whole."""
    pytest.importorskip("triton")
    results = run_on_interpreter("bias_gelu_script")
    assert len(results) == 12 and all(all(checks) for checks in results.values()), results


def test_kernels_compile_for_hopper():
    """Both kernels compile to sm90 code (Triton's own ptxas, no GPU needed)."""
    assert hopper_cubin(bias_gelu._bias_gelu_kernel,
                        {"x": "*bf16", "bias": "*bf16", "out": "*bf16", "n": "i64", "width": "i32"},
                        {"BLOCK": bias_gelu.BLOCK})
    assert hopper_cubin(bias_gelu._bias_gelu_backward_kernel,
                        {"grad": "*bf16", "x": "*bf16", "bias": "*bf16", "dx": "*bf16", "bias_sums": "*fp32",
                         "rows": "i32", "width": "i32"},
                        {"ROWS": column_sums.ROWS, "COLUMNS": column_sums.COLUMNS})


def test_erf_gelu_unless_torch_of_contiguous_gpu_tensors_only(monkeypatch):
    monkeypatch.setattr(bias_gelu, "HAVE_TRITON", True)
    for mode in ("auto", "triton"):
        monkeypatch.setenv(BIAS_GELU_ENV, mode)
        assert bias_gelu.chosen(F.gelu) and not bias_gelu.chosen(F.silu)
    monkeypatch.setenv(BIAS_GELU_ENV, "torch")
    assert not bias_gelu.chosen(F.gelu)
    monkeypatch.setattr(bias_gelu, "HAVE_TRITON", False)
    monkeypatch.setenv(BIAS_GELU_ENV, "auto")
    assert not bias_gelu.chosen(F.gelu)
    monkeypatch.setattr(bias_gelu, "HAVE_TRITON", True)
    x = torch.randn(4, 2, 8)
    cuda = type("Cuda", (), {"is_cuda": True, "shape": x.shape, "dtype": x.dtype, "is_contiguous": lambda self: True})
    fake, bias = cuda(), torch.zeros(8)
    assert bias_gelu.takes(fake, bias)
    assert not bias_gelu.takes(x, bias)  # on the CPU
    assert not bias_gelu.takes(fake, None)
    assert not bias_gelu.takes(fake, torch.zeros(4)) and not bias_gelu.takes(fake, bias.half())


class _Linear:
    """A stand-in for megatron's linear: what the MLP's forward reads of it, and its output."""

    def __init__(self, out):
        self.weight, self.sequence_parallel, self.tp_group, self.out = torch.empty(8, 8), False, None, out

    def __call__(self, hidden):
        return self.out(hidden)


@pytest.mark.parametrize("mode", [None, "auto", "torch", "triton"])
def test_the_mlp_runs_the_kernel_unless_torch(monkeypatch, mode):
    """megatron-core's forward path of our MLP with fc1's bias and activation fused: the kernel under
    auto (the default) and triton where it takes the call; the compiled function under torch; the
    summary says which."""
    from megatron_hetero.models import mlp as mlp_module

    if mode is None:
        monkeypatch.delenv(BIAS_GELU_ENV, raising=False)
    else:
        monkeypatch.setenv(BIAS_GELU_ENV, mode)
    monkeypatch.setattr(bias_gelu, "HAVE_TRITON", True)
    monkeypatch.setattr(bias_gelu, "takes", lambda *args: True)
    ran = []
    monkeypatch.setattr(bias_gelu, "bias_gelu", lambda x, bias: ran.append(("kernel", x, bias)) or x)
    monkeypatch.setattr(mlp_module, "_bias_activation_fused",
                        lambda x, bias, activation: ran.append(("compiled", x, bias)) or x)
    x, bias = torch.randn(4, 3, 8), torch.randn(8)
    module = object.__new__(mlp_module.EpilogueMLP)
    torch.nn.Module.__init__(module)
    module.linear_fc1, module.linear_fc2 = _Linear(lambda hidden: (x, bias)), _Linear(lambda hidden: (hidden, None))
    module.config = types.SimpleNamespace(activation_func=F.gelu)
    module.epilogue = types.SimpleNamespace(runs_quack=lambda work: False)
    module.pad, module.fused_bias_activation = 0, True
    out, out_bias = module(torch.randn(4, 3, 8))
    assert out is x and out_bias is None
    assert len(ran) == 1 and ran[0][0] == ("compiled" if mode == "torch" else "kernel")
    assert ran[0][1] is x and ran[0][2] is bias
    said = "activation compiled" if mode == "torch" else "GELU on Triton"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert mlp_module.mlp_summary(module).endswith(f"; torch's path: fc1 bias and {said}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no GPU: compiled, whatever the mode
    assert mlp_module.mlp_summary(module).endswith("; torch's path: fc1 bias and activation compiled")


def test_a_bad_mode_is_one_line():
    assert build(environ={BIAS_GELU_ENV: "triton"}).bias_gelu == "triton"
    with pytest.raises(KernelPolicyError, match=f"^{BIAS_GELU_ENV}=fused: use one of auto, torch, triton$"):
        build(environ={BIAS_GELU_ENV: "fused"})


@pytest.mark.skipif(not (torch.cuda.is_available() and bias_gelu.HAVE_TRITON), reason="needs a GPU with Triton")
def test_on_a_gpu_the_kernels_match_the_compiled_function():
    """On a GPU: the output, x's and the bias's gradients against the compiled bias add and GELU
    (models/mlp.py, torch.compile on, as GPU runs have it) within bf16 rounding."""
    from megatron_hetero.models.mlp import _bias_activation_fused

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((1025 * 12, 1, 4096), (1000, 2, 3200)):
        x, grad = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(2))
        bias = torch.randn(shape[-1:], device="cuda", generator=gen, dtype=torch.bfloat16)
        ours = outputs_and_gradients(bias_gelu.bias_gelu, (x, bias), grad)
        theirs = outputs_and_gradients(lambda x, b: _bias_activation_fused(x, b, F.gelu), (x, bias), grad,
                                       compiled=True)
        for mine, compiled in zip(ours, theirs, strict=True):
            torch.testing.assert_close(mine.float(), compiled.float(), rtol=2**-7, atol=1e-3)
