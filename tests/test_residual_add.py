"""A layer's residual add on our Triton kernel (models/residual_add.py), with and without InternViT's layer
scale: the kernels on Triton's CPU interpreter against fp32 arithmetic rounded once, and on a GPU
against the compiled functions; which calls they take, under which mode; the layers call them."""

import pytest
import torch
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

from megatron_hetero.models import column_sums, residual_add
from megatron_hetero.models.kernel_policy import RESIDUAL_ADD_ENV, KernelPolicyError, build
from tests.compiling import outputs_and_gradients
from tests.hopper import hopper_cubin
from tests.interpreter import run_on_interpreter


def test_kernel_adds_in_fp32_rounded_once_and_hands_back_the_gradients():
    """On Triton's CPU interpreter (tests/residual_add_script.py, a process of its own: the interpreter
    must be on before Triton is imported): bf16, fp16 and fp32, with and without the bias and the scale,
    a masked last block, rows of one element, tiles of the scaled backward masked and whole."""
    pytest.importorskip("triton")
    equal = run_on_interpreter("residual_add_script")
    assert len(equal) == 60 and all(all(checks) for checks in equal.values()), equal


def test_kernels_compile_for_hopper():
    """Both kernels compile to sm90 code with and without the bias and the scale (Triton's own ptxas, no
    GPU needed)."""
    pointers = lambda *names: {name: "*bf16" for name in names}  # noqa: E731
    for has_bias in (True, False):
        for has_scale in (True, False):
            assert hopper_cubin(residual_add._residual_add_kernel,
                                {**pointers("x", "bias", "scale", "residual", "out"), "n": "i64", "width": "i32"},
                                {"HAS_BIAS": has_bias, "HAS_SCALE": has_scale, "BLOCK": residual_add.BLOCK})
        assert hopper_cubin(residual_add._scaled_backward_kernel,
                            {**pointers("grad", "x", "bias", "scale", "dx"), "scale_sums": "*fp32",
                             "bias_sums": "*fp32", "rows": "i32", "width": "i32"},
                            {"HAS_BIAS": has_bias, "ROWS": column_sums.ROWS, "COLUMNS": column_sums.COLUMNS})


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


def test_which_adds_run_on_the_kernel_by_mode(monkeypatch):
    """Not under torch; not where training drops something; with or without a layer scale; only
    tensors the kernel takes."""
    monkeypatch.setattr(residual_add, "takes", lambda *tensors: True)
    x, scale = torch.zeros(2, 1, 4), torch.ones(4)
    adds = lambda mode, training=True, prob=0.0, scale=None: residual_add.kernel_adds(  # noqa: E731
        mode, training, prob, x, None, x, scale)
    assert adds("auto") and adds("triton") and not adds("torch")
    assert not adds("auto", prob=0.1) and adds("auto", training=False, prob=0.1)
    assert adds("triton", scale=scale) and adds("auto", scale=scale) and not adds("torch", scale=scale)
    monkeypatch.setattr(residual_add, "takes", lambda *tensors: False)
    assert not adds("triton") and not adds("triton", scale=scale)


@pytest.mark.parametrize("mode", ["auto", "triton", "torch"])
def test_internvit_layer_scale_add_on_the_kernel_unless_torch(monkeypatch, mode):
    """InternViT's layer-scale bias-dropout-add: under auto and triton, fused, the kernel with the layer's
    scale; under torch its compiled function (fused); unfused the eager one."""
    from megatron_hetero.families.internvl import vision

    monkeypatch.setenv(RESIDUAL_ADD_ENV, mode)
    monkeypatch.setattr(residual_add, "takes", lambda *tensors: True)
    calls = []
    monkeypatch.setattr(residual_add, "residual_add", lambda *tensors: calls.append(("kernel", tensors)))
    monkeypatch.setattr(vision, "_scaled_bias_dropout_add_fused", lambda *args: calls.append(("compiled", args)))
    monkeypatch.setattr(vision, "_scaled_bias_dropout_add_func", lambda *args: calls.append(("eager", args)))
    x, residual, bias, scale = torch.randn(4, 2, 8), torch.randn(4, 2, 8), torch.randn(8), torch.rand(8)
    build = vision._scaled_bias_dropout_add(scale)
    build(True, True)((x, bias), residual, 0.0)
    build(True, False)((x, bias), residual, 0.0)
    assert [c[0] for c in calls] == [("compiled" if mode == "torch" else "kernel"), "eager"]
    if mode != "torch":
        assert all(a is b for a, b in zip(calls[0][1], (x, bias, residual, scale), strict=True))


def test_takes_contiguous_tensors_of_one_shape_and_dtype_only(monkeypatch):
    monkeypatch.setattr(residual_add, "HAVE_TRITON", True)
    x = torch.randn(4, 2, 8)
    cuda = type("Cuda", (), {"is_cuda": True, "shape": x.shape, "dtype": x.dtype, "is_contiguous": lambda self: True})
    fake = cuda()
    assert residual_add.takes(fake, torch.zeros(8), fake) and residual_add.takes(fake, None, fake)
    assert not residual_add.takes(x, None, x)  # on the CPU
    assert not residual_add.takes(fake, torch.zeros(4), fake)  # not one value per column
    assert not residual_add.takes(fake, torch.zeros(8).half(), fake)  # another dtype
    assert residual_add.takes(fake, None, fake, torch.ones(8))  # a layer scale: one value per column
    assert not residual_add.takes(fake, None, fake, torch.ones(4)) and not residual_add.takes(
        fake, None, fake, torch.ones(8).half())
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
    bias-dropout-add's (dropout 0; torch.compile on, as GPU runs have it) bit for bit; the bias gradient is
    torch's sum of the same gradient."""
    from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((4096, 1, 1280), (1000, 2, 3584)):
        x, residual, grad = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
        bias = torch.randn(shape[-1:], device="cuda", generator=gen, dtype=torch.bfloat16)
        ours = outputs_and_gradients(residual_add.residual_add, (x, bias, residual), grad)
        theirs = outputs_and_gradients(lambda x, b, r: bias_dropout_add_fused_train((x, b), r, 0.0),
                                       (x, bias, residual), grad, compiled=True)
        assert all(torch.equal(ours[i], theirs[i]) for i in (0, 1, 3))  # the output, x's and residual's gradients
        assert torch.equal(ours[2], grad.reshape(-1, shape[-1]).sum(0))
        torch.testing.assert_close(ours[2], theirs[2])


@pytest.mark.skipif(not (torch.cuda.is_available() and residual_add.HAVE_TRITON), reason="needs a GPU with Triton")
def test_on_a_gpu_the_layer_scale_add_matches_the_compiled_function():
    """On a GPU: with InternViT's layer scale, the kernel's output, x's and the residual's gradients equal
    the compiled layer-scale add's (families/internvl/vision.py, dropout 0, torch.compile on) bit for bit;
    the bias's and the scale's gradients (fp32 sums in another order) within bf16 rounding of them."""
    from megatron_hetero.families.internvl.vision import _scaled_bias_dropout_add_fused

    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in ((1025 * 12, 1, 1024), (1000, 2, 3200)):
        x, residual, grad = (torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
        bias = torch.randn(shape[-1:], device="cuda", generator=gen, dtype=torch.bfloat16)
        scale = torch.rand(shape[-1:], device="cuda", generator=gen, dtype=torch.bfloat16)
        leaves = (x, bias, residual, scale)
        ours = outputs_and_gradients(residual_add.residual_add, leaves, grad)
        theirs = outputs_and_gradients(lambda x, b, r, s: _scaled_bias_dropout_add_fused(x, b, r, s, 0.0, True),
                                       leaves, grad, compiled=True)
        assert all(torch.equal(ours[i], theirs[i]) for i in (0, 1, 3))  # the output, x's and residual's gradients
        for i in (2, 4):  # the bias's and the scale's
            torch.testing.assert_close(ours[i].float(), theirs[i].float(), rtol=2**-7, atol=1e-3)
