"""The norm kernel choice and the quack path, without a GPU (CI never has quack's kernels).

- which kernel each device / import status / MEGATRON_HETERO_NORM_KERNEL gets (pure);
- our norm module on the quack path (LayerNorm, RMSNorm, zero-centered gamma, a [s, b, h] input):
  output and gradients equal to torch's F.layer_norm / F.rms_norm, through a pure-torch stand-in
  with quack's call signatures: the plumbing (which buffer is which, the statistics kept for the
  backward, the per-SM partial gradients summed) is verified here, the kernels' numbers by
  `megatron-hetero kernels check norms` on a GPU, whose judging is tested here too.
"""


import pytest
import torch
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hetero.models import norm as norm_module
from megatron_hetero.models.attention_kernels import Device
from megatron_hetero.models.kernel_policy import KernelModeError, KernelPolicy
from megatron_hetero.models.norm import SequenceParallelNorm, norm_summary
from megatron_hetero.models.norm_kernels import NORM_KERNEL_ENV, NORM_MIN_ELEMENTS, Quack, norm_kernel_for
from megatron_hetero.models.quack_kernels import QUACK, TORCH, QuackChoice, choose_quack

H100 = Device("NVIDIA H100 80GB HBM3", (9, 0))
A100 = Device("NVIDIA A100-SXM4-80GB", (8, 0))


# ---- the choice (pure) ----------------------------------------------------------------------------
@pytest.mark.parametrize("mode, device, problem, expected", [
    ("auto", H100, None, "quack"),
    ("auto", Device("NVIDIA B200", (10, 0)), None, "quack"),
    ("auto", Device("cpu"), None, "torch (no GPU)"),
    ("auto", A100, None, "torch (quack targets sm90/sm100, not NVIDIA A100-SXM4-80GB (sm80))"),
    ("auto", H100, "quack does not import (ImportError: x)", "torch (quack does not import (ImportError: x))"),
    ("torch", H100, None, f"torch ({NORM_KERNEL_ENV}=torch)"),
    ("quack", H100, None, "quack"),
    ("quack", Device("cpu"), None, "torch (no GPU)"),
])
def test_choice(mode, device, problem, expected):
    """Under auto, calls below the norms' minimum take torch's kernels (the start-up line says so);
    under quack, every call where quack can run."""
    expected = expected.replace("quack", "quack (calls of >= 2^24 elements)", mode == "auto" and expected == "quack")
    choice = choose_quack(NORM_KERNEL_ENV, mode, device, problem, NORM_MIN_ELEMENTS)
    assert str(choice) == expected
    assert choice.runs_quack(2**24) == expected.startswith("quack")
    assert choice.runs_quack(2**24 - 1) == (mode == "quack" and expected.startswith("quack"))


def test_norms_take_the_mode_of_their_configs_policy(monkeypatch):
    """A norm's kernel follows its config's kernel policy, NORM_KERNEL_ENV among its overrides; a bad
    value is the policy's one line."""
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    monkeypatch.delenv(NORM_KERNEL_ENV, raising=False)
    assert SequenceParallelNorm(config, 16).kernel == norm_kernel_for(KernelPolicy()) == QuackChoice(TORCH, "no GPU")
    monkeypatch.setenv(NORM_KERNEL_ENV, TORCH)
    assert SequenceParallelNorm(config, 16).kernel == QuackChoice(TORCH, f"{NORM_KERNEL_ENV}=torch")
    monkeypatch.setenv(NORM_KERNEL_ENV, "apex")
    with pytest.raises(KernelModeError, match=f"^{NORM_KERNEL_ENV}=apex: use one of auto, torch, quack$"):
        SequenceParallelNorm(config, 16)


# ---- the quack path, through a stand-in ---------------------------------------------------------
def _fake_fwd(x, weight, out, bias, rstd, mean, residual, residual_out, eps, is_layernorm):
    assert residual is None and residual_out is None and (mean is not None) == is_layernorm
    xf = x.float()
    if is_layernorm:
        mean.copy_(xf.mean(-1))
        xf = xf - mean[:, None]
    rstd.copy_(torch.rsqrt(xf.square().mean(-1) + eps))
    y = xf * rstd[:, None] * weight.float()
    out.copy_(y + bias.float() if bias is not None else y)


def _fake_bwd(x, weight, dout, rstd, dx, dw_partial, db_partial, dresidual_out, dresidual, sm_count, mean=None,
              is_layernorm=False):
    """quack's backward from the saved statistics alone (no eps), the weight / bias gradients as
    sm_count partial sums over row blocks; like quack, it writes nothing for no rows."""
    assert dresidual is None and dw_partial.shape[0] == sm_count
    if x.numel() == 0:
        return
    xc = x.float() - mean[:, None] if is_layernorm else x.float()
    x_hat, g = xc * rstd[:, None], dout.float() * weight.float()
    grad = g - x_hat * (g * x_hat).mean(-1, keepdim=True)
    dx.copy_(rstd[:, None] * (grad - g.mean(-1, keepdim=True) if is_layernorm else grad))
    if dresidual_out is not None:  # the residual's gradient, added into dx in the same pass
        dx.add_(dresidual_out)
    for i, rows in enumerate(torch.arange(x.shape[0]).tensor_split(sm_count)):
        dw_partial[i] = (dout.float() * x_hat)[rows].sum(0)
        if db_partial is not None:
            db_partial[i] = dout.float()[rows].sum(0)


FAKE = Quack(_fake_fwd, _fake_bwd, lambda hidden, device: 3)


def _norm(monkeypatch, kernel: str, normalization: str, zero_centered: bool, hidden=16, has_residual=False):
    monkeypatch.setattr(norm_module, "norm_kernel_for", lambda policy: QuackChoice(kernel))
    monkeypatch.setattr(norm_module, "load_quack", lambda: (FAKE, None))
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=1, normalization=normalization,
                               layernorm_zero_centered_gamma=zero_centered)
    torch.manual_seed(0)
    module = SequenceParallelNorm(config, hidden, eps=1e-5, has_residual=has_residual)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.1 if p is module.bias else 1.0, 0.2)
    return module


def test_calls_below_the_minimum_take_torchs_kernels(monkeypatch):
    """A norm on quack with a minimum: a call of fewer elements runs torch's norm, not quack's."""
    module = _norm(monkeypatch, QUACK, "LayerNorm", False)
    module.kernel = QuackChoice(QUACK, min_work=7 * 2 * 16)
    calls = []
    counted = FAKE._replace(fwd=lambda *args: calls.append(1) or FAKE.fwd(*args))
    monkeypatch.setattr(norm_module, "load_quack", lambda: (counted, None))
    for rows in (6, 7):
        module(torch.randn(rows, 2, 16)).sum().backward()
    assert calls == [1]


@pytest.mark.parametrize("normalization, zero_centered", [("LayerNorm", False), ("LayerNorm", True),
                                                          ("RMSNorm", False), ("RMSNorm", True)])
def test_quack_path_equals_torch(monkeypatch, normalization, zero_centered):
    """Output and every gradient of the module on the stand-in equal torch's path, on [s, b, h] (in
    float64, to fp32's precision: the path keeps its statistics in fp32, as quack does)."""
    x = torch.randn(7, 2, 16, dtype=torch.float64) * 2 + 0.5
    dout = torch.randn(7, 2, 16, dtype=torch.float64)
    runs = {}
    for kernel in (TORCH, QUACK):
        module = _norm(monkeypatch, kernel, normalization, zero_centered).double()
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out.backward(dout)
        runs[kernel] = [out, leaf.grad, *(p.grad for p in module.parameters())]
    assert len(runs[QUACK]) == (3 if normalization == "RMSNorm" else 4)
    for got, want in zip(runs[QUACK], runs[TORCH]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_no_rows_give_zero_parameter_gradients(monkeypatch):
    """A rank with no tokens (an empty [0, b, h] input): zero weight and bias gradients, not the
    uninitialized partials quack leaves untouched."""
    module = _norm(monkeypatch, QUACK, "LayerNorm", False)
    module(torch.randn(0, 2, 16, requires_grad=True)).sum().backward()
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in module.parameters())


def test_summary_names_the_kernel(monkeypatch):
    module = torch.nn.Sequential(_norm(monkeypatch, QUACK, "LayerNorm", False), torch.nn.Linear(2, 2))
    assert norm_summary(module) == "quack"
    assert norm_summary(torch.nn.Linear(2, 2)) == "none"


# ---- the GPU check's judging ----------------------------------------------------------------------
def _check_tool(monkeypatch, quack: Quack):
    from megatron_hetero.cli.checks import norms as check

    monkeypatch.setattr(check, "DEVICE", "cpu")
    monkeypatch.setattr(check, "load_quack", lambda: (quack, None))
    return check


def _wrong_weight_gradient(quack: Quack) -> Quack:
    def bwd(*args, **kwargs):
        quack.bwd(*args, **kwargs)
        args[5].mul_(1.5)  # dw_partial
    return Quack(quack.fwd, bwd, quack.sm_count)


def test_gpu_check_passes_a_right_kernel_and_fails_a_wrong_weight_gradient(monkeypatch):
    cases = [(rms, hidden) for rms in (False, True) for hidden in (8, 24)]
    tool = _check_tool(monkeypatch, FAKE)
    for rms, hidden in cases:
        record = tool.measure(tool.Case("test", rms, hidden, 40), iters=0)
        assert record["ok"] and record["torch_dx_err"] < tool.TOLERANCE, record
    tool = _check_tool(monkeypatch, _wrong_weight_gradient(FAKE))
    for rms, hidden in cases:
        record = tool.measure(tool.Case("test", rms, hidden, 40), iters=0)
        assert not record["ok"] and record["quack_dw_err"] > 0.2 and record["quack_dx_err"] < tool.TOLERANCE, record


@pytest.mark.parametrize("kernel", [TORCH, QUACK])
@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_a_layers_norm_hands_back_the_residual(monkeypatch, kernel, normalization):
    """has_residual: (output, input), as a layer's residual add takes it; the input's gradient is the
    norm's plus the residual's (quack's kernel adds the second), as one norm of a tensor used twice."""
    x = torch.randn(7, 2, 16, dtype=torch.float64) * 2 + 0.5
    douts = torch.randn(2, 7, 2, 16, dtype=torch.float64)
    runs = []
    for has_residual in (False, True):
        module = _norm(monkeypatch, kernel, normalization, False, has_residual=has_residual).double()
        leaf = x.clone().requires_grad_()
        out = module(leaf)
        out, residual = out if has_residual else (out, leaf)
        assert torch.equal(residual, leaf)
        (out * douts[0] + residual * douts[1]).sum().backward()
        runs.append([out, leaf.grad, *(p.grad for p in module.parameters())])
    for got, want in zip(*runs):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_norms_checkpointed_or_offloaded_alone_keep_one_output():
    """Where megatron checkpoints a norm alone (its checkpoint frees the outputs) or offloads its
    input, a layer's norm returns its output alone."""
    from megatron_hetero.models.norm import passes_residual

    def config(**fields):
        return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1, **fields)

    assert passes_residual(config())
    assert passes_residual(config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1))
    assert passes_residual(config(recompute_granularity="selective", recompute_modules=["core_attn"]))
    assert not passes_residual(config(recompute_granularity="selective", recompute_modules=["layernorm"]))
    module = SequenceParallelNorm(config(recompute_granularity="selective", recompute_modules=["layernorm"]), 16,
                                  has_residual=True)
    assert isinstance(module(torch.randn(3, 1, 16)), torch.Tensor)
