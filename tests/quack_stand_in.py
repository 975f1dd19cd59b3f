"""A pure-torch stand-in for quack's epilogue GEMMs (quack.gemm_interface's gemm_act / gemm_dact: their
call signatures and outputs, gated units' layout as its gemm_act_ref lays it out), for CPU tests of the
MLP's fused path; GPUs check the real kernels (`megatron-hetero kernels check mlp`)."""

import torch

from megatron_hetero.models import mlp as mlp_module
from megatron_hetero.models.mlp_kernels import ACTIVATIONS, GATED, QuackGemm, halves
from megatron_hetero.models.quack_kernels import QUACK, QuackChoice


def interleave(t):
    """quack's _concat_interleave: [first; second] halves along t's non-contiguous dim -> [f0, s0, f1, ...]."""
    dim = -2 if t.stride(-1) == 1 else -1
    return t.unflatten(dim, (2, t.shape[dim] // 2)).transpose(dim - 1, dim).flatten(dim - 1, dim)


def _act(activation, preact):
    """The activation of quack's pre-activation: a gated unit's gate and up interleaved."""
    return ACTIVATIONS[activation](halves(preact) if activation in GATED else preact)


def gemm_act(A, B, bias=None, activation=None, tuned=True, concat_layout=None):
    """(preact, postact) = (A @ B + bias, activation of it); concat_layout ("B",): B's halves interleaved
    first (a gated unit's [gate; up] weight), ("B", "bias"): the bias's halves too (its
    _act_concat_bias); a bias without "bias" is taken as laid out, interleaved."""
    assert concat_layout in (None, ("B",), ("B", "bias"))
    B = interleave(B) if concat_layout else B
    if concat_layout and "bias" in concat_layout and bias is not None:
        bias = bias.unflatten(0, (2, -1)).t().flatten()
    preact = A @ B if bias is None else A @ B + bias
    return preact, _act(activation, preact)


def gemm_dact(A, B, PreAct, activation=None, tuned=True):
    """(dpreact, postact): A @ B (the activation's output gradient) times the activation's derivative at
    PreAct, and the activation of PreAct recomputed (a gated unit's: both in PreAct's layout)."""
    with torch.enable_grad():
        x = PreAct.detach().requires_grad_()
        y = _act(activation, x)
        (dx,) = torch.autograd.grad(y, x, A @ B)
    return dx, y.detach()


STAND_IN = QuackGemm(gemm_act, gemm_dact)


def use_stand_in(set_attribute, gemm: QuackGemm = STAND_IN) -> None:
    """MLPs built after this run their fused path on `gemm`, on any device and dtype: `set_attribute`
    is pytest's monkeypatch.setattr, or setattr in a process of its own."""
    set_attribute(mlp_module, "mlp_kernel_for", lambda policy: QuackChoice(QUACK))
    set_attribute(mlp_module, "load_quack_gemm", lambda: (gemm, None))
    set_attribute(mlp_module, "epilogue_input", lambda x: True)
    set_attribute(mlp_module, "EPILOGUE_DTYPES", (torch.bfloat16, torch.float16, torch.float32, torch.float64))
