"""Which attention kernel a module runs: torch SDPA everywhere, flash-attn-4 (FA4, the optional `fa4`
extra) where it can be trusted.

flash-attn-4 4.0.0b36's backward is silently wrong at some head dims (72 and 80 on the H100: dq/dk/dv
~100% off against fp32 attention while every forward is right; docs/attention.md). So FA4 is
chosen per shape, never by import alone: it must import, the GPU's architecture must be one it
targets (Hopper sm90, Blackwell sm100), and the head dim must be one whose gradients were checked on
that GPU model (CHECKED_HEAD_DIMS). Elsewhere torch SDPA; CPUs always.

Megatron's own `--attention-backend` chooses (Megatron-LM users already pass it, default auto; it
reaches every module's TransformerConfig as `attention_backend`, and Transformer Engine's layers read
it in their own sense where they are used instead of ours):
- auto: FA4 where it is checked, SDPA elsewhere. An unchecked head dim is not padded for one dense
  call: zero-padding to a checked one is exact but was slower than cuDNN on the H100 (GPU-KERNELS.md,
  pad check) and at W1's ViT on the H200 (docs/attention.md). Packed (varlen) calls are padded: SDPA
  runs them one launch per segment shape, and the padded varlen call was twice as fast on the
  H200's packed Qwen2.5-VL ViT (16 x 80 -> 96: 6.28 against 12.64 ms fwd+bwd, docs/attention.md).
- flash: FA4 for every module, an unchecked head dim zero-padded to the next checked one with the
  true head dim's softmax scale (exact, at the padded FLOPs); where FA4 cannot run exactly, one line
  saying why (AttentionKernelError), never a silent fallback.
- fused, unfused, local: torch SDPA (torch picks its cuDNN, flash or memory-efficient kernel).
`--flash-attention-version` 2 or 3 pins a generation we do not run: no FA4.
Under auto, a packed call whose segments are all short (SHORT_SEGMENTS: Qwen2.5-VL's windows) runs
our Triton kernel for them (models/short_attention.py: one program per segment and head) on GPUs where
`kernels check attention` passed it (SHORT_ATTENTION_CHECKED), else torch's own varlen flash-attention
(FA2, part of torch's CUDA builds) at its true head dim where that kernel runs (torch_flash_runs): one
launch, nothing padded, no tokens permuted. MEGATRON_HETERO_SHORT_ATTENTION picks between the two.

The choice is pure (choose_kernel: device, import status, dtype, head dim in, a KernelChoice out),
so that it is tested without a GPU; kernel_for(policy, ...) feeds it a layer's kernel policy
(kernel_policy.of(config)) and this process's facts.
"""

import functools
import importlib.util
import inspect
from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from megatron_hetero.models.chunk_attention import cudnn_merge_checked
from megatron_hetero.models.kernel_policy import (
    CHECKED_HEAD_DIMS,
    SHORT_ATTENTION_CHECKED,
    SHORT_ATTENTION_ENV,
    AttentionKernelError,
    KernelPolicy,
)
from megatron_hetero.models.short_attention import HAVE_TRITON, MAX_HEAD_DIM, MAX_SEGMENT

FA4 = "fa4"
SDPA = "sdpa"
TORCH_FLASH = "torch-flash"  # torch's own varlen flash-attention (FA2, built into torch's CUDA wheels)
TRITON_SHORT = "triton-short"  # ours for short segments (models/short_attention.py)

# CHECKED_HEAD_DIMS (kernel_policy.py, from kernel_checks.json): head dims whose flash-attn-4 gradients
# (dq, dk, dv against fp32 math attention, max |diff| / max |ref| as small as cuDNN's: 0.003-0.005) were
# checked, by GPU model as torch.cuda.get_device_name() names it. Source: a gradient check against fp32,
# one H100, 2026-11-25, flash-attn-4 4.0.0b36 (hd 72 and 80 failed there: 0.98 and 1.29); the H200's from
# `megatron-hetero kernels check attention` (cli/checks/attention.py), 2026-11-26, and its 72 and 80 on
# 2026-12-05 with patches/fa4_backward.py's fix (0.0018-0.0062 of fp32), which re-checks every listed
# dim and prints the head dims that pass on the GPU it runs on: add a GPU (or a wheel version) only
# from its output. The policy's
# fa4_head_dims (MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS) add to it, never remove.
FA4_ARCH_MAJORS = (9, 10)  # sm90 (H100, H200), sm100 (B200, GB200)
# flash-attn-4's Hopper backward kernel class in its releases up to 4.0.0b40 rounds its tiles' head dim
# to 16 (this line of its __init__) while the interface rounds the dQ accumulator to DQ_MULTIPLE: dQ is
# wrong at head dims 72 and 80 unless fixed (upstream's pull request 2896, patches/fa4_backward.py).
UNFIXED_SM90_ROUNDING = "64 if dKV_swapAB else 16"
DQ_MULTIPLE = 32
FA4_DTYPES = (torch.bfloat16, torch.float16)
FA4_INSTALL = "pip install 'megatron-hetero[fa4]'"
# Packed calls whose segments are all this short (one 128-row tile: Qwen2.5-VL's 112-px windows hold at most
# 64 patches; short_attention.MAX_SEGMENT, its one tile of keys) run torch's varlen flash-attention or our
# Triton kernel (short_kernel) at the true head dim, one launch, nothing padded or permuted. On one H200
# (tools/gpu_vit_probe.py, 2026-12-04), the bench's 419 windows x 16 heads x 80 on torch's kernel:
# 0.88 ms forward+backward against 1.90 on flash-attn-4 padded to 96 and 2.02 on SDPA grouped by shape;
# whole images (up to 9,216 patches) ran slower on it: 12.2 ms against 6.6 and 8.2.
SHORT_SEGMENTS = MAX_SEGMENT
TORCH_FLASH_DTYPES = (torch.bfloat16, torch.float16)
TORCH_FLASH_MAX_HEAD_DIM = 256


@dataclass(frozen=True)
class Device:
    name: str  # torch.cuda.get_device_name(), or "cpu"
    capability: tuple[int, int] | None = None  # None: no CUDA device


@dataclass(frozen=True)
class KernelChoice:
    """kernel: FA4, TRITON_SHORT, TORCH_FLASH or SDPA; head_dim: the module's; run_head_dim: what the kernel computes
    at (FA4 at an unchecked head dim: the checked one it is zero-padded to); reason: why not FA4
    (TORCH_FLASH, TRITON_SHORT: which calls it takes, and why that one); merged_chunks:
    on SDPA, a causal query chunk behind a longer key prefix (CP's later chunks) runs as two merged
    calls (chunk_attention.py: CPUs, and GPUs where checked) instead of SDPA's bottom-right mask."""

    kernel: str
    head_dim: int
    run_head_dim: int
    reason: str = ""
    merged_chunks: bool = False

    def __str__(self) -> str:
        if self.kernel == TORCH_FLASH:
            return f"torch flash varlen (head dim {self.head_dim}: {self.reason})"
        if self.kernel == TRITON_SHORT:
            return f"triton short segments (head dim {self.head_dim}: {self.reason})"
        if self.kernel == SDPA:
            return f"sdpa (head dim {self.head_dim}{': ' + self.reason if self.reason else ''})"
        if self.run_head_dim != self.head_dim:
            return f"fa4 (head dim {self.head_dim} zero-padded to {self.run_head_dim})"
        return f"fa4 (head dim {self.head_dim})"

    def describe(self, cp: int) -> str:
        """str(self), with how CP's later chunks are attended where the module runs CP on SDPA."""
        if cp == 1 or self.kernel != SDPA:
            return str(self)
        chunks = "as merged calls" if self.merged_chunks else "on SDPA's mask"
        return f"{self}, CP chunks {chunks}"


def rounds_to_16(init) -> bool:
    """Whether a Hopper backward kernel class's __init__ rounds the tiles' head dim to 16 (False where its
    source cannot be read)."""
    try:
        return UNFIXED_SM90_ROUNDING in inspect.getsource(init)
    except (OSError, TypeError):
        return False


def sm90_backward_class():
    """flash-attn-4's Hopper backward kernel class, or None where flash-attn-4 does not load."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn.cute.flash_bwd_sm90 import FlashAttentionBackwardSm90
    except Exception:  # the CuTe DSL failing to load its libraries: load_fa4 says why
        return None
    return FlashAttentionBackwardSm90


def sm90_dq_wrong_off_32() -> bool:
    """Whether this install's Hopper backward still gets dQ wrong at head dims that are not multiples of
    DQ_MULTIPLE: a release's rounding, not wrapped by patches/fa4_backward.py (which keeps the original as
    __wrapped__; it cannot apply while flash-attn-4's disk cache of kernels is on)."""
    kernel = sm90_backward_class()
    return kernel is not None and not hasattr(kernel.__init__, "__wrapped__") and rounds_to_16(kernel.__init__)


def checked_head_dims(device: Device, policy: KernelPolicy) -> tuple[int, ...]:
    """CHECKED_HEAD_DIMS's entry for the GPU, with the policy's fa4_head_dims added; on Hopper, without
    the head dims that are not multiples of DQ_MULTIPLE where its backward is unfixed here (a check
    passed them with the fix)."""
    dims = {*CHECKED_HEAD_DIMS.get(device.name, ()), *policy.fa4_head_dims}
    if device.capability is not None and device.capability[0] == 9 and sm90_dq_wrong_off_32():
        dims = {d for d in dims if d % DQ_MULTIPLE == 0}
    return tuple(sorted(dims))


def fa4_problem(device: Device, import_problem: str | None, dtype: torch.dtype, dropout: float,
                flash_attention_version: int | None, checked: tuple[int, ...]) -> str | None:
    """Why FA4 cannot run this module at all (whatever its head dim), or None."""
    if device.capability is None:
        return "no GPU"
    if device.capability[0] not in FA4_ARCH_MAJORS:
        return f"flash-attn-4 targets sm90/sm100, not {device.name} (sm{device.capability[0]}{device.capability[1]})"
    if flash_attention_version not in (None, 4):
        return f"--flash-attention-version {flash_attention_version}: megatron-hetero's layers run flash-attn-4 only"
    if import_problem:
        return import_problem
    if dtype not in FA4_DTYPES:
        return f"flash-attn-4 runs bf16/fp16, not {str(dtype).removeprefix('torch.')} (--bf16)"
    if dropout > 0:
        return f"attention dropout {dropout}: flash-attn-4 has none"
    if not checked:
        return (f"flash-attn-4's gradients are not checked on {device.name}: run `megatron-hetero kernels check "
                f"attention --record` there")
    return None


def torch_flash_runs(device: Device, available: bool, dtype: torch.dtype, dropout: float, head_dim: int) -> bool:
    """Whether torch's varlen flash-attention runs this call: built into this torch (`available`:
    torch.backends.cuda.is_flash_attention_available()), an Ampere or later GPU, bf16 / fp16, no dropout, a head
    dim that is a multiple of 8 up to 256 (the kernel's own limits)."""
    return (available and device.capability is not None and device.capability >= (8, 0) and dtype in TORCH_FLASH_DTYPES
            and dropout == 0 and head_dim % 8 == 0 and head_dim <= TORCH_FLASH_MAX_HEAD_DIM)


def triton_short_runs(device: Device, available: bool, dtype: torch.dtype, dropout: float, head_dim: int) -> bool:
    """Whether our Triton kernel for short segments runs this call: Triton imports (`available`), an
    Ampere or later GPU, bf16 / fp16, no dropout, a head dim up to MAX_HEAD_DIM."""
    return (available and device.capability is not None and device.capability >= (8, 0) and dtype in TORCH_FLASH_DTYPES
            and dropout == 0 and head_dim <= MAX_HEAD_DIM)


def short_kernel(device: Device, dtype: torch.dtype, dropout: float, head_dim: int, short_mode: str,
                 short_checked: bool, triton: bool, torch_flash: bool) -> KernelChoice | None:
    """Under auto, the kernel of a packed call whose segments are all short: ours on Triton where
    `short_mode` asks for it ("triton") or, under "auto", where this GPU passed its check
    (`short_checked`); else torch's varlen flash-attention where it runs; None: neither runs here."""
    limit = f"segments of at most {SHORT_SEGMENTS} tokens"
    if short_mode != "torch" and triton_short_runs(device, triton, dtype, dropout, head_dim):
        if short_mode == "triton":
            return KernelChoice(TRITON_SHORT, head_dim, head_dim, f"{limit}, {SHORT_ATTENTION_ENV}=triton")
        if short_checked:
            return KernelChoice(TRITON_SHORT, head_dim, head_dim, f"{limit}, checked on {device.name}")
    if torch_flash_runs(device, torch_flash, dtype, dropout, head_dim):
        return KernelChoice(TORCH_FLASH, head_dim, head_dim, limit)
    return None


def choose_kernel(mode: str, head_dim: int, device: Device, *, import_problem: str | None = None,
                  dtype: torch.dtype = torch.bfloat16, dropout: float = 0.0,
                  flash_attention_version: int | None = None, checked: tuple[int, ...] = (),
                  packed: bool = False, merge_checked: bool = False, longest: int | None = None,
                  torch_flash: bool = False, short_mode: str = "auto", short_checked: bool = False,
                  triton: bool = False) -> KernelChoice:
    """The kernel of a module with this head dim under `mode` (backend_mode); `checked`: the head dims
    checked on `device` (checked_head_dims); packed: the module attends within the segments of a
    packed sequence (varlen: padded under auto too), `longest` of them at most (None: unbounded;
    SHORT_SEGMENTS or fewer: under auto short_kernel's, with `short_mode` (kernel_policy.TRITON_MODES),
    `short_checked` (this GPU passed the Triton kernel's check), `triton` (Triton imports) and
    `torch_flash` (torch's varlen flash-attention is built in)); merge_checked: merged chunks were
    checked on this GPU at this dtype and head dim (chunk_attention.cudnn_merge_checked). Raises
    AttentionKernelError where mode "flash" cannot be served exactly."""
    short = packed and longest is not None and longest <= SHORT_SEGMENTS
    if short and mode == "auto":
        choice = short_kernel(device, dtype, dropout, head_dim, short_mode, short_checked, triton, torch_flash)
        if choice is not None:
            return choice
    merged = dropout == 0 and (device.capability is None or merge_checked)
    if mode == SDPA:
        return KernelChoice(SDPA, head_dim, head_dim, "chosen by --attention-backend", merged)
    problem = fa4_problem(device, import_problem, dtype, dropout, flash_attention_version, checked)
    if problem is None and head_dim in checked:
        return KernelChoice(FA4, head_dim, head_dim)
    padded = next((d for d in sorted(checked) if d > head_dim), None)
    if problem is None and (mode == "flash" or packed) and padded is not None:
        return KernelChoice(FA4, head_dim, padded)
    if problem is None:
        problem = f"not among the head dims checked on {device.name} ({', '.join(map(str, checked))})"
    if mode == "flash":
        raise AttentionKernelError(f"--attention-backend flash: head dim {head_dim}: {problem}; or use "
                                   f"--attention-backend auto")
    return KernelChoice(SDPA, head_dim, head_dim, problem, merged)


def current_device() -> Device:
    if not torch.cuda.is_available():
        return Device("cpu")
    return Device(torch.cuda.get_device_name(), torch.cuda.get_device_capability())


class _Dense(torch.autograd.Function):
    """flash-attn-4's dense attention with its output laid out in memory as q is.

    forward: out = softmax(q k^T * scale [causal]) v, FA4's kernel writing into torch.empty_like(q);
    backward: dq, dk, dv from FA4's backward kernel (each allocated by it like its input).

    Why not flash_attn_func: it allocates the output contiguous [b, s, h, d], while Megatron's layers
    hold [s, b, h, d] and hand FA4 its transposed view. Flattened back to [s, b, h * d] that output is
    not a dense matrix, so the output projection copied it twice per layer and microbatch (torch.matmul
    in its forward, `prepare_input_tensors_for_wgrad_compute` in its weight gradient): by count 128 of
    the 176 strided copies (63 ms together) in W1's profiled step on one H200 (docs/runs/benchmarks.md). Written
    in q's memory order, the flattened output is contiguous. The two entries are
    flash_attn.cute.interface's, called as its own FlashAttnFunc calls them (the `fa4` extra pins
    the version).
    """

    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, fa4):
        assert v.shape[-1] == q.shape[-1], "the output takes q's layout: v's head dim must be q's"
        out, lse = fa4.fwd(q, k, v, softmax_scale=softmax_scale, causal=causal, out=torch.empty_like(q),
                           return_lse=True)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.bwd = softmax_scale, causal, fa4.bwd
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(q, k, v, out, dout, lse, ctx.softmax_scale, ctx.causal)[:3]
        return dq, dk, dv, None, None, None


class _TorchFlashVarlen(torch.autograd.Function):
    """torch's own varlen flash-attention on packed q [total_q, heads, d], k, v [total_k, kv heads, d].

    forward: out = softmax(q k^T * scale [causal]) v within each segment of cu_q / cu_k
    (aten._flash_attention_forward, the entry torch.nn.attention.varlen calls for short segments);
    backward: dq, dk, dv from aten._flash_attention_backward. Called through aten because the public
    varlen_attn hands longer segments to cuDNN, whose varlen gradients were wrong on torch 2.11
    (tools/gpu_vit_probe.py: dq off by 1e35 on the bench's images)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, ops):
        out, lse, rng, unused, _ = ops.fwd(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, rng, unused)
        ctx.max_q, ctx.max_k, ctx.scale, ctx.causal, ctx.bwd = max_q, max_k, scale, causal, ops.bwd
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_q, cu_k, rng, unused = ctx.saved_tensors
        dq, dk, dv = ctx.bwd(dout.contiguous(), q, k, v, out, lse, cu_q, cu_k, ctx.max_q, ctx.max_k, 0.0, ctx.causal,
                             rng, unused, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None, None, None, None


class TorchFlash(NamedTuple):
    """torch's varlen flash-attention entries, aten._flash_attention_forward and _backward (stand-ins
    with their signatures in tests)."""

    fwd: Callable
    bwd: Callable


def torch_flash_varlen(q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                       ops: TorchFlash | None = None) -> torch.Tensor:
    """Attention within packed segments on torch's varlen flash-attention (differentiable)."""
    ops = ops or TorchFlash(torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward)
    return _TorchFlashVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, ops)


class Fa4(NamedTuple):
    """flash-attn-4's entries: its dense kernels' forward and backward (`_flash_attn_fwd`,
    `_flash_attn_bwd`), and varlen_func([total, h, d] x3, ...)."""

    fwd: Callable
    bwd: Callable
    varlen_func: Callable

    def func(self, q, k, v, *, softmax_scale: float, causal: bool) -> torch.Tensor:
        """Dense attention, q [b, s, h, d], k, v [b, s, hk, d] -> [b, s, h, d] in q's memory order."""
        return _Dense.apply(q, k, v, softmax_scale, causal, self)


def import_failure(package: str, error: Exception) -> str:
    """Why a package of the `fa4` extra (flash-attn-4, quack) does not import, in one line."""
    first_line = (str(error).splitlines() or [""])[0][:100]
    return f"{package} does not import ({type(error).__name__}: {first_line}); {FA4_INSTALL}"


@functools.cache
def load_fa4() -> tuple[Fa4 | None, str | None]:
    """(flash-attn-4's entries, None), or (None, why it does not import)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except Exception as error:  # ImportError, or the CuTe DSL failing to load its libraries
        return None, import_failure("flash-attn-4", error)
    return Fa4(_flash_attn_fwd, _flash_attn_bwd, flash_attn_varlen_func), None


def kernel_for(policy: KernelPolicy, head_dim: int, dtype: torch.dtype, dropout: float = 0.0,
               packed: bool = False, longest: int | None = None) -> KernelChoice:
    """choose_kernel for a module on this process's GPU under `policy` (its attention mode, Megatron's
    --flash-attention-version and the overrides): the module's head dim, compute dtype (config_dtype),
    dropout, whether it runs packed (varlen) calls and the longest segment they may have."""
    device = current_device()
    import_problem = None
    if policy.attention != SDPA and device.capability is not None:
        import_problem = load_fa4()[1]
    gpu = device.capability is not None
    return choose_kernel(policy.attention, head_dim, device, import_problem=import_problem, dtype=dtype,
                         dropout=dropout, flash_attention_version=policy.flash_attention_version,
                         checked=checked_head_dims(device, policy) if gpu else (), packed=packed,
                         merge_checked=gpu and cudnn_merge_checked(device.name, dtype, head_dim, policy),
                         longest=longest, torch_flash=gpu and torch.backends.cuda.is_flash_attention_available(),
                         short_mode=policy.short_attention, short_checked=device.name in SHORT_ATTENTION_CHECKED,
                         triton=HAVE_TRITON)


def check_policy(policy: KernelPolicy, head_dims: Callable[[], dict[str, int]], dtype: torch.dtype) -> None:
    """--attention-backend flash: every module's attention (head_dims(): name -> head dim, asked only
    here) on flash-attn-4 where our layers run it (not Transformer Engine's), or AttentionKernelError
    naming the module and why not."""
    if policy.attention != "flash" or policy.te:
        return
    for name, head_dim in head_dims().items():
        try:
            kernel_for(policy, head_dim, dtype)
        except AttentionKernelError as error:
            raise AttentionKernelError(f"module {name}: {error}") from None


def config_dtype(config) -> torch.dtype:
    """The dtype a TransformerConfig's layers compute attention in."""
    return torch.bfloat16 if config.bf16 else torch.float16 if config.fp16 else config.params_dtype


def run_fa4(fn: Callable, choice: KernelChoice, q, k, v, **kwargs) -> torch.Tensor:
    """fn(q, k, v, **kwargs) (Fa4.func or varlen_func) at the choice's head dim:
    q, k, v zero-padded on the last dim where it is larger (the caller passes the true head dim's
    softmax_scale: q.k and P.v are unchanged, the padded output columns are zero and cut off); FA4
    returns (out, lse) or out, depending on its version."""
    pad = choice.run_head_dim - q.shape[-1]
    if pad:
        q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    out = out[0] if isinstance(out, tuple) else out
    return out[..., : out.shape[-1] - pad] if pad else out
