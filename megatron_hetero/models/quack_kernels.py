"""Whether a kind of layer runs quack's kernels (quack-kernels, installed with the `fa4` extra, which
flash-attn-4 itself depends on) or torch's: one rule for the norms (norm_kernels.py) and the MLP's
fused GEMMs (mlp_kernels.py).

quack's kernels target Hopper (sm90) and Blackwell (sm100); elsewhere (CPU, CI, other GPUs, quack
not importable) torch's. Each kind has its own environment variable (auto, the default, or torch:
torch's kernels on every device, for A/B runs or a suspected kernel), so that one can be pinned
without the other. The choice is pure (choose_quack), so that it is tested without a GPU.
"""

import os
from dataclasses import dataclass
from typing import Callable

from megatron_hetero.models.attention_kernels import Device, current_device

QUACK = "quack"
TORCH = "torch"
KERNEL_MODES = ("auto", TORCH)
QUACK_ARCH_MAJORS = (9, 10)  # sm90 (H100, H200), sm100 (B200, GB200): the archs quack's kernels target


class KernelModeError(ValueError):
    """A kernel environment variable whose value is not a mode; one line saying which are."""


@dataclass(frozen=True)
class QuackChoice:
    """kernel: QUACK or TORCH; reason: why not quack (or, on quack, what it runs: the MLP's activation)."""

    kernel: str
    reason: str = ""

    def __str__(self) -> str:
        return f"{self.kernel}{' (' + self.reason + ')' if self.reason else ''}"


def kernel_mode(env: str, environ=os.environ) -> str:
    """The variable `env`'s value ("auto" where unset); KernelModeError for another."""
    mode = environ.get(env, "auto") or "auto"
    if mode not in KERNEL_MODES:
        raise KernelModeError(f"{env}={mode}: use one of {', '.join(KERNEL_MODES)}")
    return mode


def choose_quack(env: str, mode: str, device: Device, import_problem: str | None = None) -> QuackChoice:
    """The kernel of one kind of layer under `mode` (kernel_mode(env)) on `device`; import_problem:
    why quack's entries for this kind do not load, if they do not."""
    if mode == TORCH:
        return QuackChoice(TORCH, f"{env}=torch")
    if device.capability is None:
        return QuackChoice(TORCH, "no GPU")
    if device.capability[0] not in QUACK_ARCH_MAJORS:
        return QuackChoice(TORCH, f"quack targets sm90/sm100, not {device.name} "
                                  f"(sm{device.capability[0]}{device.capability[1]})")
    if import_problem:
        return QuackChoice(TORCH, import_problem)
    return QuackChoice(QUACK)


def quack_kernel_for(env: str, load: Callable) -> QuackChoice:
    """choose_quack for this process: `env`'s mode and its GPU; load() gives (quack's entries for this
    kind, None) or (None, why they do not load), asked only where quack could run."""
    mode, device = kernel_mode(env), current_device()
    import_problem = load()[1] if mode != TORCH and device.capability is not None else None
    return choose_quack(env, mode, device, import_problem)
