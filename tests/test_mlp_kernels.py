"""The MLP's fused GEMMs without a GPU (CI never has quack's kernels).

- which MLPs take the fused path: the activation megatron-core would compute, the linears, the
  kernel rule and MEGATRON_HETERO_MLP_KERNEL (pure), and where quack's epilogues cannot be keyed;
- epilogue_mlp on a pure-torch stand-in with quack's call signatures (tests/quack_stand_in.py):
  output and every gradient equal torch's MLP, weight gradients into main_grad as megatron's
  gradient-accumulation fusion does, frozen parts; the module in megatron's layers under TP / SP is
  tested in test_layers.py, the kernels' numbers by `megatron-hetero kernels check mlp` on a GPU,
  whose judging is tested here.
"""

import functools
import json
import types

import pytest
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel import layers as tp_layers
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models.attention_kernels import Device
from megatron_hetero.models.kernel_policy import KernelPolicy
from megatron_hetero.models.mlp_kernels import (
    ACTIVATIONS,
    GATED,
    MLP_KERNEL_ENV,
    QuackGemm,
    _dsl_location_problem,
    epilogue_mlp,
    mlp_kernel_for,
    pad_ffn,
    padded_fc1,
    padded_swiglu_mlp,
    pairs_as_words,
    quack_activation,
)
from megatron_hetero.models.quack_kernels import QUACK, TORCH, QuackChoice, choose_quack
from megatron_hetero.spec.sizes import MLP_MIN_MACS
from tests.compiling import assert_compiled_equals_eager
from tests.hopper import hopper_cubin
from tests.interpreter import run_on_interpreter
from tests.quack_stand_in import STAND_IN, interleave


def _config(**fields) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, **fields)


# ---- which MLPs (pure) --------------------------------------------------------------------------
@pytest.mark.parametrize("fields, expected", [
    ({}, "gelu_erf"),
    ({"add_bias_linear": True, "bias_activation_fusion": True}, "gelu_tanh_approx"),  # megatron's bias_gelu_impl
    ({"activation_func": functools.partial(F.gelu, approximate="tanh")}, "gelu_tanh_approx"),
    ({"activation_func": F.silu, "gated_linear_unit": True}, "swiglu"),
    ({"activation_func": F.silu, "gated_linear_unit": True, "glu_linear_offset": 1.0}, None),
    ({"activation_func": F.silu, "gated_linear_unit": True, "activation_func_clamp_value": 7.0}, None),
    ({"gated_linear_unit": True}, None),
    ({"activation_func": F.silu}, None),
    ({"activation_func": functools.partial(F.gelu, approximate="none")}, None),
])
def test_activation_megatron_would_compute(fields, expected):
    assert quack_activation(_config(**fields)) == expected


def test_which_mlps_take_the_fused_path(monkeypatch):
    """The reasons in the start-up line, in the order checked: the kernel rule's, the activations'
    dtype, the activation, the linears (none: a spec's own), fc1's biases of a gated unit (under
    MLP_KERNEL_ENV=quack only), their widths (a gated unit's ffn is padded: its input width only)."""
    from megatron_hetero.models.mlp import epilogue_choice

    quack = QuackChoice(QUACK)
    bf16 = {"params_dtype": torch.bfloat16, "bf16": True}
    assert epilogue_choice(_config(**bf16), None, None, QuackChoice(TORCH, "no GPU")) == QuackChoice(TORCH, "no GPU")
    assert str(epilogue_choice(_config(), None, None, quack)) == \
        "torch (torch.float32 activations: quack's GEMMs take bf16 / fp16)"
    assert str(epilogue_choice(_config(gated_linear_unit=True, **bf16), None, None, quack)) == \
        "torch (an activation quack's epilogues do not compute)"
    assert str(epilogue_choice(_config(**bf16), None, None, quack)) == "torch (linears NoneType / NoneType)"
    fc1, fc2 = object.__new__(ColumnParallelLinear), object.__new__(RowParallelLinear)
    for width, expected in ((1152, "quack (gelu_erf)"), (1076, "torch (fc1 of (1076, 1152) per TP rank: quack's "
                                                             "GEMMs need widths that are multiples of 8)")):
        for name, value in dict(is_expert=False, disable_grad_reduce=False, weight=torch.empty(width, 1152),
                                bias=None).items():
            object.__setattr__(fc1, name, value)  # SigLIP's 4304 over TP4 is 1076
        assert str(epilogue_choice(_config(**bf16), fc1, fc2, quack)) == expected
    # SwiGLU: fc1 biases under MLP_KERNEL_ENV=quack, or on a GPU model where `kernels check mlp` passed; an
    # unaligned ffn padded (Qwen2.5-VL's ViT: 3420).
    from megatron_hetero.models import mlp as mlp_module

    monkeypatch.setattr(mlp_module, "current_device", lambda: Device("cpu"))  # a GPU's name may be in the table
    monkeypatch.delenv(MLP_KERNEL_ENV, raising=False)
    swiglu = _config(activation_func=F.silu, gated_linear_unit=True, **bf16)
    biased = ("torch (a gated MLP with fc1 biases (quack's gated bias layout not checked on cpu: megatron-hetero "
              f"kernels check mlp --record; {MLP_KERNEL_ENV}=quack runs it))")
    for mode, rows, hidden, bias, expected in (
            ("auto", 2 * 1024, 1152, None, "quack (swiglu)"), ("auto", 2 * 1024, 1152, torch.empty(2048), biased),
            ("quack", 2 * 3420, 1280, torch.empty(2 * 3420), "quack (swiglu)"),
            ("auto", 2 * 1076, 1152, None, "quack (swiglu)"),
            ("auto", 2 * 1024, 1156, None, "torch (fc1 of (2048, 1156) per TP rank: quack's GEMMs need widths "
                                           "that are multiples of 8)")):
        monkeypatch.setenv(MLP_KERNEL_ENV, mode)
        object.__setattr__(fc1, "weight", torch.empty(rows, hidden))
        object.__setattr__(fc1, "bias", bias)
        assert str(epilogue_choice(swiglu, fc1, fc2, quack)) == expected
    monkeypatch.setenv(MLP_KERNEL_ENV, "auto")
    object.__setattr__(fc1, "weight", torch.empty(2 * 1024, 1152))
    object.__setattr__(fc1, "bias", torch.empty(2048))
    monkeypatch.setattr(mlp_module, "GATED_BIAS_MLP_CHECKED", ("cpu",))  # this process's device, as if checked
    assert str(epilogue_choice(swiglu, fc1, fc2, quack)) == "quack (swiglu)"


def test_mode_and_rule():
    from megatron_hetero.models.mlp import epilogue_choice

    assert mlp_kernel_for(KernelPolicy(mlp=TORCH)) == QuackChoice(TORCH, f"{MLP_KERNEL_ENV}=torch")
    h100 = Device("NVIDIA H100 80GB HBM3", (9, 0))
    assert str(choose_quack(MLP_KERNEL_ENV, "torch", h100, None, MLP_MIN_MACS)) == f"torch ({MLP_KERNEL_ENV}=torch)"
    assert str(choose_quack(MLP_KERNEL_ENV, "quack", h100, None, MLP_MIN_MACS)) == "quack"
    auto = choose_quack(MLP_KERNEL_ENV, "auto", h100, None, MLP_MIN_MACS)
    assert str(auto) == "quack (calls of >= 2^36 multiply-adds)"
    assert auto.runs_quack(2**36) and not auto.runs_quack(2**36 - 1)
    # The MLP's own checks keep the minimum (the MLP's forward asks runs_quack with fc1's work).
    fc1, fc2 = object.__new__(ColumnParallelLinear), object.__new__(RowParallelLinear)
    for name, value in dict(is_expert=False, disable_grad_reduce=False, weight=torch.empty(64, 16)).items():
        object.__setattr__(fc1, name, value)
    bf16 = _config(params_dtype=torch.bfloat16, bf16=True)
    assert str(epilogue_choice(bf16, fc1, fc2, auto)) == "quack (gelu_erf; calls of >= 2^36 multiply-adds)"


def test_calls_below_the_minimum_take_megatrons_forward(monkeypatch):
    """The MLP's work is fc1's multiply-adds on this rank (tokens in its GEMM x hidden x ffn): below the
    minimum megatron-core's forward runs, at it the epilogue path."""
    from megatron.core.transformer.mlp import MLP

    from megatron_hetero.models import mlp as mlp_module

    ran = []
    monkeypatch.setattr(MLP, "forward", lambda self, x, scale=None, **kwargs: ran.append("megatron") or (x, None))
    monkeypatch.setattr(mlp_module, "epilogue_mlp", lambda x, *args: ran.append("epilogue") or x)
    monkeypatch.setattr(mlp_module, "copy_to_tensor_model_parallel_region", lambda x, group: x)
    monkeypatch.setattr(mlp_module, "reduce_from_tensor_model_parallel_region", lambda x, group: x)
    monkeypatch.setattr(mlp_module, "load_quack_gemm", lambda: (STAND_IN, None))
    monkeypatch.setattr(mlp_module, "epilogue_input", lambda x: True)
    fc1, fc2 = (types.SimpleNamespace(weight=torch.empty(24, 8), bias=None, sequence_parallel=False, tp_group=None,
                                      gradient_accumulation_fusion=False) for _ in range(2))
    module = object.__new__(mlp_module.EpilogueMLP)
    torch.nn.Module.__init__(module)
    module.linear_fc1, module.linear_fc2, module.config = fc1, fc2, _config(params_dtype=torch.bfloat16, bf16=True)
    module.epilogue = QuackChoice(QUACK, "gelu_erf", min_work=5 * 3 * 8 * 24)
    module.activation, module.pad, module.fused_bias_activation = "gelu_erf", 0, False
    for tokens in (4, 5):
        module(torch.randn(tokens, 3, 8))
    assert ran == ["megatron", "epilogue"]
    # Under sequence parallelism fc1's GEMM takes the sequence gathered over TP (2 here): 3 of 6 rows.
    monkeypatch.setattr(mlp_module, "gather_from_sequence_parallel_region", lambda x, group: x)
    monkeypatch.setattr(mlp_module, "reduce_scatter_to_sequence_parallel_region", lambda x, group: x)
    for linear in (fc1, fc2):
        linear.sequence_parallel, linear.tp_group = True, types.SimpleNamespace(size=lambda: 2)
    for tokens in (2, 3):
        module(torch.randn(tokens, 3, 8))
    assert ran == ["megatron", "epilogue", "megatron", "epilogue"]


def test_which_swiglu_mlps_pad_their_ffn(monkeypatch):
    """A SwiGLU MLP pads its per-rank ffn to a multiple of 8 in bf16 (Qwen2.5-VL's ViT: 3420 -> 3424), on
    quack's GEMMs or torch's; not where the ffn is aligned, fp32, or its config's policy pins megatron's
    MLP (MLP_KERNEL_ENV=torch)."""
    from megatron_hetero.models import mlp as mlp_module

    monkeypatch.delenv(MLP_KERNEL_ENV, raising=False)
    swiglu = _config(activation_func=F.silu, gated_linear_unit=True, params_dtype=torch.bfloat16, bf16=True)
    fc1, fc2 = object.__new__(ColumnParallelLinear), object.__new__(RowParallelLinear)
    for name, value in dict(is_expert=False, disable_grad_reduce=False).items():
        object.__setattr__(fc1, name, value)
    biased = QuackChoice(TORCH, "a gated MLP with fc1 biases (quack's gated bias layout not checked)")
    for ffn, kernel, config, expected in ((3420, biased, swiglu, 4), (3424, biased, swiglu, 0),
                                          (3420, QuackChoice(QUACK, "swiglu"), swiglu, 4),
                                          (3420, biased, _config(activation_func=F.silu, gated_linear_unit=True), 0),
                                          (3420, biased, _config(params_dtype=torch.bfloat16, bf16=True), 0)):
        object.__setattr__(fc2, "weight", torch.empty(1280, ffn))
        assert mlp_module.ffn_padding(config, fc1, fc2, kernel) == expected
    monkeypatch.setenv(MLP_KERNEL_ENV, TORCH)
    object.__setattr__(fc2, "weight", torch.empty(1280, 3420))
    assert mlp_module.ffn_padding(swiglu, fc1, fc2, biased) == 0


@pytest.mark.parametrize("bias", [True, False])
def test_padded_swiglu_equals_megatrons_mlp(bias):
    """Output and every gradient of the padded path equal megatron-core's unfused SwiGLU MLP (fc1, its
    bias, silu(gate) * up, fc2), at the shapes of the weights given (the pads sliced off)."""
    torch.manual_seed(0)
    x = torch.randn(5, 7, 16, dtype=torch.float64, requires_grad=True)
    w1 = torch.randn(2 * 27, 16, dtype=torch.float64, requires_grad=True)
    b1 = torch.randn(2 * 27, dtype=torch.float64, requires_grad=True) if bias else None
    w2 = torch.randn(12, 27, dtype=torch.float64, requires_grad=True)
    out = padded_swiglu_mlp(x, w1, b1, w2, 5)
    ref = ACTIVATIONS["swiglu"](F.linear(x, w1, b1)) @ w2.t()
    assert out.shape == ref.shape == (5, 7, 12)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    grad, inputs = torch.randn_like(ref), [t for t in (x, w1, b1, w2) if t is not None]
    for ours, theirs in zip(torch.autograd.grad(out, inputs, grad), torch.autograd.grad(ref, inputs, grad)):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-11)


@pytest.mark.parametrize("activation", [F.gelu, functools.partial(F.gelu, approximate="tanh"), F.silu],
                         ids=["gelu", "gelu_tanh", "silu"])
def test_compiled_bias_activation_equals_eager(activation):
    """The bias add and activation that megatron-core's forward runs unfused, compiled (torch.compile:
    the tests' processes turn it off, on here): output and the input's and bias's gradients."""
    from megatron_hetero.models.mlp import _bias_activation, _bias_activation_fused

    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(9, 2, 16, generator=g), torch.randn(16, generator=g)]
    dout = torch.randn(9, 2, 16, generator=g)
    assert_compiled_equals_eager(
        lambda compiled, x, bias: (_bias_activation_fused if compiled else _bias_activation)(x, bias, activation),
        leaves, dout, tol=1e-6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the rule without a GPU")
def test_cpu_runs_torch():
    assert mlp_kernel_for(KernelPolicy()) == QuackChoice(TORCH, "no GPU")


def test_epilogues_need_the_dsl_under_site_packages():
    """quack's epilogue cache key stops at installed code it recognizes by its directory; a `pip
    --target` install elsewhere makes every epilogue GEMM refuse to compile (2026-11-27, one H200)."""
    assert _dsl_location_problem("/usr/lib/python3.12/site-packages/cutlass/__init__.py") is None
    assert _dsl_location_problem("/usr/lib/python3/dist-packages/cutlass/__init__.py") is None
    problem = _dsl_location_problem("/root/fasite/nvidia_cutlass_dsl/python_packages/cutlass/__init__.py")
    assert problem == ("quack's epilogue GEMMs need nvidia-cutlass-dsl installed under a site-packages "
                       "directory, not /root/fasite/nvidia_cutlass_dsl/python_packages")


# ---- the fused path on the stand-in --------------------------------------------------------------
def _torch_mlp(x, w1, b1, w2, activation):
    preact = x @ w1.t() if b1 is None else x @ w1.t() + b1
    return ACTIVATIONS[activation](preact) @ w2.t()


def _leaves(bias: bool, frozen: tuple[str, ...] = (), gated: bool = False):
    """x [5, 3, 8], fc1 [24, 8] (gated: [gate; up] of 12 each), fc2 [8, ffn]."""
    torch.manual_seed(0)
    tensors = dict(x=torch.randn(5, 3, 8, dtype=torch.float64), w1=torch.randn(24, 8, dtype=torch.float64) / 3,
                   b1=torch.randn(24, dtype=torch.float64) if bias else None,
                   w2=torch.randn(8, 12 if gated else 24, dtype=torch.float64) / 5)
    return {k: (v.requires_grad_(k not in frozen) if v is not None else None) for k, v in tensors.items()}


def _run(mlp, leaves, activation):
    out = mlp(leaves["x"], leaves["w1"], leaves["b1"], leaves["w2"], activation)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    return out.detach(), {k: v.grad for k, v in leaves.items() if v is not None and v.requires_grad}


def _fused(gemm=STAND_IN, fusion=False):
    return lambda x, w1, b1, w2, activation: epilogue_mlp(x, w1, b1, w2, activation, fusion, gemm)


@pytest.mark.parametrize("bias, activation", [(False, "gelu_erf"), (True, "gelu_erf"), (True, "gelu_tanh_approx"),
                                              (False, "swiglu"), (True, "swiglu")])
@pytest.mark.parametrize("frozen", [(), ("w1", "b1"), ("x", "w1", "b1"), ("w2",)])
def test_fused_path_equals_torch(bias, activation, frozen):
    """[s, b, h] in, output and every gradient as torch's MLP, frozen parts (no gradient) included:
    with x and fc1 frozen fc2's weight gradient recomputes the activation with torch. SwiGLU: fc1 as
    megatron-core lays it out ([gate; up]), its bias too, the GEMMs' pre-activation interleaved as
    quack's is."""
    gated = activation == "swiglu"
    got = _run(_fused(), _leaves(bias, frozen, gated), activation)
    want = _run(_torch_mlp, _leaves(bias, frozen, gated), activation)
    assert got[1].keys() == want[1].keys()
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-12, atol=1e-12, msg=name)


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_padded_fused_path_equals_torch(monkeypatch, bias, fusion):
    """A gated unit's ffn zero-padded in quack's GEMMs (Qwen2.5-VL's ViT: 3420 -> 3424): output and every
    gradient as torch's unpadded MLP, at the parameters' shapes; under gradient-accumulation fusion the
    weight gradients added to main_grad (twice: two microbatches) as without padding, else in .grad."""
    _accumulating(monkeypatch)
    leaves = _leaves(bias, gated=True)
    for weight in (leaves["w1"], leaves["w2"]):
        weight.main_grad = torch.full_like(weight, 0.5)
    fused = lambda x, w1, b1, w2, activation: epilogue_mlp(x, w1, b1, w2, activation, fusion, STAND_IN, 5)  # noqa: E731
    out, grads = _run(fused, leaves, "swiglu")
    got = out, {name: grad.clone() for name, grad in grads.items() if grad is not None}
    got_main = {name: leaves[name].main_grad.clone() for name in ("w1", "w2")}
    if fusion:
        _run(fused, leaves, "swiglu")
    want = _run(_torch_mlp, _leaves(bias, gated=True), "swiglu")
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for name in want[1]:
        if fusion and name in ("w1", "w2"):
            assert got[1].get(name) is None
            torch.testing.assert_close(got_main[name], 0.5 + want[1][name], rtol=1e-12, atol=1e-12, msg=name)
            torch.testing.assert_close(leaves[name].main_grad, 0.5 + 2 * want[1][name], rtol=1e-12, atol=1e-12)
        else:
            assert got[1][name].shape == want[1][name].shape
            torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-12, atol=1e-12, msg=name)
    if not fusion:
        assert (leaves["w1"].main_grad == 0.5).all() and (leaves["w2"].main_grad == 0.5).all()


@pytest.mark.parametrize("bias", [True, False])
def test_padded_fc1_is_quacks_interleave_of_the_padded_halves(bias):
    """padded_fc1's weight and bias are what quack's concat layout would make of the zero-padded [gate; up]
    ones (its _concat_interleave, as the stand-in follows it): the GEMM without the concat layout on them
    computes what it computed with it on the [gate; up] ones."""
    leaves = _leaves(bias, gated=True)
    w1, b1, _ = pad_ffn(leaves["w1"].detach(), leaves["b1"], leaves["w2"].detach(), 5)
    got_w, got_b = padded_fc1(leaves["w1"].detach(), leaves["b1"], 5)
    assert torch.equal(got_w, interleave(w1.t()).t())
    assert got_b is None if not bias else torch.equal(got_b, b1.detach().unflatten(0, (2, -1)).t().flatten())


def _accumulating(monkeypatch):
    """megatron's fused_weight_gradient_mlp_cuda as the plugin provides it, in fp64 on the CPU."""
    def accumulate(total_input, grad_output, main_grad):
        main_grad.add_(grad_output.t() @ total_input)
    module = types.SimpleNamespace(wgrad_gemm_accum_fp32=accumulate, wgrad_gemm_accum_fp16=accumulate)
    monkeypatch.setattr(tp_layers, "fused_weight_gradient_mlp_cuda", module, raising=False)


def test_weight_gradients_accumulate_into_main_grad(monkeypatch):
    """Under gradient-accumulation fusion: main_grad += the weight gradient (twice: two microbatches),
    and DDP's placeholder returned with grad_added_to_main_grad set, as megatron's linear layers do."""
    _accumulating(monkeypatch)
    leaves = _leaves(bias=True)
    for weight in (leaves["w1"], leaves["w2"]):
        weight.main_grad = torch.full_like(weight, 0.5)
        weight.grad_added_to_main_grad = False
        weight.zero_out_wgrad = True  # the placeholder is zeros: nothing else to add
    for _ in range(2):
        _run(_fused(fusion=True), leaves, "gelu_erf")
    want = _run(_torch_mlp, _leaves(bias=True), "gelu_erf")[1]
    for name in ("w1", "w2"):
        weight = leaves[name]
        torch.testing.assert_close(weight.main_grad, 0.5 + 2 * want[name], rtol=1e-12, atol=1e-12)
        assert weight.grad_added_to_main_grad and torch.equal(weight.grad, torch.zeros_like(weight))
    torch.testing.assert_close(leaves["b1"].grad, 2 * want["b1"], rtol=1e-12, atol=1e-12)


# ---- the GPU check's judging ----------------------------------------------------------------------
def _check_tool(monkeypatch, gemm: QuackGemm):
    from megatron_hetero.cli.checks import mlp as check

    _accumulating(monkeypatch)
    monkeypatch.setattr(check, "DEVICE", "cpu")
    monkeypatch.setattr(check, "load_quack_gemm", lambda: (gemm, None))
    return check


def _wrong_derivative(gemm: QuackGemm) -> QuackGemm:
    def dact(*args, **kwargs):
        dpreact, postact = gemm.dact(*args, **kwargs)
        return dpreact * 1.5, postact
    return QuackGemm(gemm.act, dact)


def test_gpu_check_passes_a_right_kernel_and_fails_a_wrong_derivative(monkeypatch):
    """Every activation with and without fc1 biases; the gated ones at an ffn of 44, padded to 48 as the
    model's MLP pads it."""
    cases = [(bias, activation) for bias in (False, True) for activation in ACTIVATIONS]
    for gemm, right in ((STAND_IN, True), (_wrong_derivative(STAND_IN), False)):
        tool = _check_tool(monkeypatch, gemm)
        for bias, activation in cases:
            ffn = 44 if activation in GATED else 48
            record = tool.measure(tool.Case("test", 64, 16, ffn, bias, activation), iters=0)
            assert record["ok"] == right and record["torch_dx_err"] < tool.TOLERANCE, record
            if not right:  # the input gradient and fc1's gradients are off, fc2's are not
                assert record["quack_dx_err"] > 0.2 and record["quack_dw2_err"] < tool.TOLERANCE, record


def test_gpu_check_records_the_gpu_where_it_passed(monkeypatch, tmp_path, capsys):
    """`kernels check mlp --record`: a pass writes the GPU model into the user's table (the list under which
    auto runs a gated MLP with fc1 biases on quack's epilogues); without --record, the line saying how; a
    failure writes nothing."""
    from megatron_hetero.cli.checks import mlp as tool
    from megatron_hetero.models import kernel_policy

    monkeypatch.setattr(tool.grad_accum_fusion, "apply", lambda: None)  # what training patches: not judged here
    table = tmp_path / "checks.json"
    monkeypatch.setenv(kernel_policy.USER_CHECKS_ENV, str(table))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA B200")
    for status, record in ((1, True), (0, False), (0, True)):
        monkeypatch.setattr(tool, "run_table", lambda *_, status=status: status)
        assert tool.main(True, str(tmp_path), record) == status
        out = capsys.readouterr().out
        if status == 0 and not record:
            assert "run again with --record, or export MEGATRON_HETERO_MLP_KERNEL=quack" in out
        assert table.exists() == (status == 0 and record)
    assert "recorded NVIDIA B200 in" in out
    assert json.loads(table.read_text())["gated_bias_mlp_checked"] == ["NVIDIA B200"]


def test_halves_kernel_is_torchs_copy_bit_for_bit():
    """The gated pre-activation's halves copy in Triton (one pass of whole (gate, up) 32-bit words) on
    Triton's CPU interpreter (tests/mlp_triton_script.py, in a process of its own: the interpreter must be
    on before Triton is imported): torch's strided copy, bit for bit, bf16 and fp16, a masked last block."""
    pytest.importorskip("triton")
    equal = run_on_interpreter("mlp_triton_script")
    assert len(equal) == 6 and all(equal.values()), equal


def test_halves_kernel_compiles_for_hopper():
    """The halves kernel compiles to sm90 code (Triton's own ptxas, no GPU needed)."""
    from megatron_hetero.models import mlp_kernels

    assert hopper_cubin(mlp_kernels._halves_kernel, {"pairs": "*i32", "out": "*i16", "n": "i32"},
                        {"BLOCK": mlp_kernels.PAIRS_BLOCK})


def test_halves_takes_words_only_where_they_are_aligned_pairs():
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert pairs_as_words(x) and not pairs_as_words(x.float()) and not pairs_as_words(x.t())
    assert not pairs_as_words(x.view(-1)[1:9]) and not pairs_as_words(x[:, :1])
