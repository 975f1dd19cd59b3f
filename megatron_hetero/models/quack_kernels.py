"""Whether a kind of layer runs quack's kernels (quack-kernels, installed with the `fa4` extra, which
flash-attn-4 itself depends on) or torch's: one rule for the norms (norm_kernels.py) and the MLP's
fused GEMMs (mlp_kernels.py).

quack's kernels target Hopper (sm90) and Blackwell (sm100); elsewhere (CPU, CI, other GPUs, quack
not importable) torch's. Each kind has its own mode in the kernel policy (kernel_policy.py: its own
environment variable), so that one can be pinned without the other: auto (the default), torch
(torch's kernels on every device, for A/B runs or a suspected kernel) or quack (quack's on every call
where it can run: its loss checks on small models).

Under auto a call whose work is below its kind's minimum (min_work) takes torch's kernels: a quack
call costs the host more time than torch's, and a small model's step is bound by the host, not the
GPU. On one H200 the 200-step loss model of benchmarks/gpu_fa4_check.sh (4 + 4 layers of width 1024 /
1152, 8,192 tokens a microbatch) ran 13-20% slower per step on quack's norms and MLPs, while W1, W3
and W4 (widths 1152-4096, 23,328-32,768 tokens) ran 1-2% faster (docs/runs/benchmarks.md); each kind's
minimum lies between the two. The choice is pure (choose_quack), so that it is tested without a GPU.
"""

from dataclasses import dataclass
from typing import Callable

from megatron_hetero.models.attention_kernels import Device, current_device

QUACK = "quack"
TORCH = "torch"
QUACK_ARCH_MAJORS = (9, 10)  # sm90 (H100, H200), sm100 (B200, GB200): the archs quack's kernels target


@dataclass(frozen=True)
class QuackChoice:
    """kernel: QUACK or TORCH; reason: why not quack (or, on quack, what it runs: the MLP's activation);
    min_work: on quack, calls of less work (in `unit`s, the kind's measure) take torch's kernels."""

    kernel: str
    reason: str = ""
    min_work: int = 0
    unit: str = ""

    def runs_quack(self, work: int) -> bool:
        """Whether a call of this much work runs quack's kernels."""
        return self.kernel == QUACK and work >= self.min_work

    def __str__(self) -> str:
        notes = [self.reason] if self.reason else []
        if self.kernel == QUACK and self.min_work:
            notes.append(f"calls of >= 2^{self.min_work.bit_length() - 1} {self.unit}".rstrip())
        return self.kernel + (f" ({'; '.join(notes)})" if notes else "")


def choose_quack(env: str, mode: str, device: Device, import_problem: str | None = None,
                 min_work: tuple[int, str] = (0, "")) -> QuackChoice:
    """The kernel of one kind of layer under `mode` (the policy's, set by `env`) on `device`; import_problem:
    why quack's entries for this kind do not load, if they do not; min_work: the kind's minimum work
    per quack call under auto (a power of two) and its unit."""
    if mode == TORCH:
        return QuackChoice(TORCH, f"{env}=torch")
    if device.capability is None:
        return QuackChoice(TORCH, "no GPU")
    if device.capability[0] not in QUACK_ARCH_MAJORS:
        return QuackChoice(TORCH, f"quack targets sm90/sm100, not {device.name} "
                                  f"(sm{device.capability[0]}{device.capability[1]})")
    if import_problem:
        return QuackChoice(TORCH, import_problem)
    return QuackChoice(QUACK, min_work=min_work[0] if mode == "auto" else 0, unit=min_work[1])


def quack_kernel_for(env: str, mode: str, load: Callable, min_work: tuple[int, str] = (0, "")) -> QuackChoice:
    """choose_quack for this process: the policy's mode (set by `env`) and its GPU; load() gives
    (quack's entries for this kind, None) or (None, why they do not load), asked only where quack
    could run."""
    device = current_device()
    import_problem = load()[1] if mode != TORCH and device.capability is not None else None
    return choose_quack(env, mode, device, import_problem, min_work)
