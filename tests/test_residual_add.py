"""A layer's residual add on our Triton kernel (models/residual_add.py): the kernel on Triton's CPU
interpreter against fp32 arithmetic rounded once, and on a GPU against megatron-core's compiled
function; which calls it takes, under which mode; the layers our specs build call it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_hetero.models import residual_add
from megatron_hetero.models.kernel_policy import RESIDUAL_ADD_ENV, KernelPolicyError, build


def test_kernel_adds_in_fp32_rounded_once_and_hands_back_the_gradients():
    """On Triton's CPU interpreter (tests/residual_add_script.py, a process of its own: the interpreter
    must be on before Triton is imported): bf16, fp16 and fp32, with and without the bias, a masked last
    block, rows of one element."""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-m", "tests.residual_add_script"], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"}, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr[-3000:]
    equal = json.loads(done.stdout.splitlines()[-1])
    assert len(equal) == 18 and all(all(pair) for pair in equal.values()), equal


def test_kernel_compiles_for_hopper():
    """The kernel compiles to sm90 code with and without the bias (Triton's own ptxas, no GPU needed)."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for has_bias in (True, False):
        source = ASTSource(residual_add._residual_add_kernel,
                           {"x": "*bf16", "bias": "*bf16", "residual": "*bf16", "out": "*bf16", "n": "i64",
                            "width": "i32", "HAS_BIAS": "constexpr", "BLOCK": "constexpr"},
                           constexprs={"HAS_BIAS": has_bias, "BLOCK": residual_add.BLOCK})
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


@pytest.mark.parametrize("mode", [None, "auto", "triton"])
def test_the_kernel_where_it_takes_the_call_unless_the_torch_mode_asks(monkeypatch, mode):
    """auto (the default) and triton: the kernel where it takes the call, megatron-core's where the dropout
    is on in training or the tensors are not a GPU's; torch, or no fusion asked: megatron-core's own function."""
    def same(training, fused):  # the unfused one is a closure made at each call
        ours, upstream = residual_add.bias_dropout_add(training, fused), get_bias_dropout_add(training, fused)
        return ours is upstream or (not fused and ours.__qualname__ == upstream.__qualname__)

    monkeypatch.setenv(RESIDUAL_ADD_ENV, "torch")
    assert all(same(training, fused) for training in (True, False) for fused in (True, False))
    if mode is None:
        monkeypatch.delenv(RESIDUAL_ADD_ENV)
    else:
        monkeypatch.setenv(RESIDUAL_ADD_ENV, mode)
    assert same(True, False) and same(False, False) and not same(True, True) and not same(False, True)
    calls = []
    monkeypatch.setattr(residual_add, "get_bias_dropout_add",  # upstream's, recording its calls
                        lambda training, fused: lambda x_with_bias, residual, prob: calls.append(("upstream", prob)))
    monkeypatch.setattr(residual_add, "residual_add", lambda *tensors: calls.append(("kernel", tensors)))
    x, residual, bias = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(8)
    train, evaluate = residual_add.bias_dropout_add(True, True), residual_add.bias_dropout_add(False, True)
    train((x, bias), residual, 0.0)  # CPU tensors: upstream's
    monkeypatch.setattr(residual_add, "takes", lambda *tensors: True)
    train((x, bias), residual, 0.0)
    train((x, bias), residual, 0.5)  # dropout in training: upstream's
    evaluate((x, bias), residual, 0.5)  # evaluation drops nothing
    assert [c[0] for c in calls] == ["upstream", "kernel", "upstream", "kernel"]
    assert calls[1][1][0] is x and calls[1][1][1] is bias and calls[1][1][2] is residual


def test_takes_contiguous_tensors_of_one_shape_and_dtype_only(monkeypatch):
    monkeypatch.setattr(residual_add, "HAVE_TRITON", True)
    x = torch.randn(4, 2, 8)
    cuda = type("Cuda", (), {"is_cuda": True, "shape": x.shape, "dtype": x.dtype, "is_contiguous": lambda self: True})
    fake = cuda()
    assert residual_add.takes(fake, torch.zeros(8), fake) and residual_add.takes(fake, None, fake)
    assert not residual_add.takes(x, None, x)  # on the CPU
    assert not residual_add.takes(fake, torch.zeros(4), fake)  # not one value per column
    assert not residual_add.takes(fake, torch.zeros(8).half(), fake)  # another dtype
    other = cuda()
    other.shape = torch.Size([4, 1, 8])
    assert not residual_add.takes(fake, None, other)


def test_our_layers_call_it_and_a_bad_mode_is_one_line():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_hetero.models.specs import with_our_layers

    layer = with_our_layers(get_gpt_layer_local_spec(), None)
    assert layer.submodules.self_attn_bda is layer.submodules.mlp_bda is residual_add.bias_dropout_add
    assert build(environ={RESIDUAL_ADD_ENV: "torch"}).residual_add == "torch"
    with pytest.raises(KernelPolicyError, match=f"^{RESIDUAL_ADD_ENV}=fused: use one of auto, torch, triton$"):
        build(environ={RESIDUAL_ADD_ENV: "fused"})


@pytest.mark.skipif(not (torch.cuda.is_available() and residual_add.HAVE_TRITON), reason="needs a GPU with Triton")
def test_on_a_gpu_the_kernel_is_the_compiled_function_bit_for_bit():
    """On a GPU: the kernel's output and the input gradients equal megatron-core's compiled
    bias-dropout-add's (dropout 0) bit for bit; the bias gradient is torch's sum of the same gradient."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((4096, 1, 1280), (1000, 2, 3584)):
        x, residual, grad = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
        bias = torch.randn(shape[-1:], device="cuda", generator=gen, dtype=torch.bfloat16)
        outs, grads = [], []
        compiled = lambda x, b, r: bias_dropout_add_fused_train((x, b), r, 0.0)  # noqa: E731
        for add in (residual_add.residual_add, compiled):
            inputs = [t.clone().requires_grad_() for t in (x, bias, residual)]
            out = add(*inputs)
            out.backward(grad)
            outs.append(out)
            grads.append([t.grad for t in inputs])
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][2], grads[1][2])
        assert torch.equal(grads[0][1], grad.reshape(-1, shape[-1]).sum(0))
        torch.testing.assert_close(grads[0][1], grads[1][1])
