"""A pure-torch stand-in for quack's epilogue GEMMs (quack.gemm_interface's gemm_act / gemm_dact: their
call signatures and outputs), for CPU tests of the MLP's fused path; GPUs check the real kernels
(tools/gpu_mlp_check.py)."""

import torch

from megatron_hetero.models import mlp as mlp_module
from megatron_hetero.models.mlp_kernels import ACTIVATIONS, QuackGemm
from megatron_hetero.models.quack_kernels import QUACK, QuackChoice


def gemm_act(A, B, bias=None, activation=None, tuned=True):
    """(preact, postact) = (A @ B + bias, activation of it)."""
    preact = A @ B if bias is None else A @ B + bias
    return preact, ACTIVATIONS[activation](preact)


def gemm_dact(A, B, PreAct, activation=None, tuned=True):
    """(dpreact, postact): A @ B (the activation's output gradient) times the activation's derivative at
    PreAct, and the activation of PreAct recomputed."""
    with torch.enable_grad():
        x = PreAct.detach().requires_grad_()
        y = ACTIVATIONS[activation](x)
        (dx,) = torch.autograd.grad(y, x, A @ B)
    return dx, y.detach()


STAND_IN = QuackGemm(gemm_act, gemm_dact)


def use_stand_in(set_attribute, gemm: QuackGemm = STAND_IN) -> None:
    """MLPs built after this run their fused path on `gemm`, on any device and dtype: `set_attribute`
    is pytest's monkeypatch.setattr, or setattr in a process of its own."""
    set_attribute(mlp_module, "mlp_kernel_for", lambda: QuackChoice(QUACK))
    set_attribute(mlp_module, "load_quack_gemm", lambda: (gemm, None))
    set_attribute(mlp_module, "epilogue_input", lambda x: True)
    set_attribute(mlp_module, "EPILOGUE_DTYPES", (torch.bfloat16, torch.float16, torch.float32, torch.float64))
