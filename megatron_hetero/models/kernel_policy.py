"""Which kernels this process's layers may run: one frozen KernelPolicy, built once from Megatron's
`--attention-backend`, `--flash-attention-version` and `--transformer-impl` and the documented
overrides below (the only place they are read), validated with the arguments (patches/arguments.py,
so every entry script stops on a bad value with the same line) and consulted by the layers
(`current()`). Per call the layers still decide by shape and device (attention_kernels.choose_kernel,
quack_kernels.choose_quack); the policy fixes what they decide among.

Overrides (environment variables):
- MEGATRON_HETERO_NORM_KERNEL, MEGATRON_HETERO_MLP_KERNEL: auto (default), torch or quack;
- MEGATRON_HETERO_EXPERTS_KERNEL: auto (default), grouped or sequential: an MoE layer's experts on
  grouped GEMMs or megatron-core's SequentialMLP loop (models/experts.py);
- MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS: head dims ("64,96,128") just checked on this GPU by
  tools/gpu_fa4_check.py, added to the table;
- MEGATRON_HETERO_CUDNN_MERGE_CHECKED=1: this GPU passed benchmarks/gpu_cp_chunk_check.py;
- MEGATRON_HETERO_EAGER_ROPE=1: upstream's unfused RoPE (patches/rope.py), to compare.

The checked tables (FA4 head dims and merged-chunk GPUs by torch.cuda.get_device_name()) are
kernel_checks.json beside this file, written by the kernel checks (`--record`: record_check).
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

from megatron.core.transformer.enums import AttnBackend

from megatron_hetero.models.accelerators import imports

HAVE_TE = imports("transformer_engine")

NORM_KERNEL_ENV = "MEGATRON_HETERO_NORM_KERNEL"
MLP_KERNEL_ENV = "MEGATRON_HETERO_MLP_KERNEL"
EXPERTS_KERNEL_ENV = "MEGATRON_HETERO_EXPERTS_KERNEL"
CHECKED_ENV = "MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS"
CUDNN_MERGE_ENV = "MEGATRON_HETERO_CUDNN_MERGE_CHECKED"
EAGER_ROPE_ENV = "MEGATRON_HETERO_EAGER_ROPE"
KERNEL_MODES = ("auto", "torch", "quack")
EXPERTS_MODES = ("auto", "grouped", "sequential")
CHECKS_FILE = Path(__file__).with_name("kernel_checks.json")

_CHECKS = json.loads(CHECKS_FILE.read_text())
CHECKED_HEAD_DIMS: dict[str, tuple[int, ...]] = {
    gpu: tuple(dims) for gpu, dims in _CHECKS["fa4_checked_head_dims"].items()}
CUDNN_MERGE_CHECKED: tuple[str, ...] = tuple(_CHECKS["cudnn_merge_checked"])


def record_check(gpu: str, fa4_head_dims: tuple[int, ...] | None = None, cudnn_merge: bool = False,
                 path: Path = CHECKS_FILE) -> None:
    """A kernel check's passing result into the tables: `gpu`'s FA4 head dims (tools/gpu_fa4_check.py),
    `gpu` among the merged-chunk GPUs (benchmarks/gpu_cp_chunk_check.py)."""
    checks = json.loads(path.read_text())
    if fa4_head_dims is not None:
        checks["fa4_checked_head_dims"][gpu] = sorted(fa4_head_dims)
    if cudnn_merge and gpu not in checks["cudnn_merge_checked"]:
        checks["cudnn_merge_checked"].append(gpu)
    path.write_text(json.dumps(checks, indent=2) + "\n")


class KernelPolicyError(ValueError):
    """A kernel flag or override that cannot work; one line naming it and the fix."""


class KernelModeError(KernelPolicyError):
    """A kernel environment variable whose value is not a mode; one line saying which are."""


class AttentionKernelError(KernelPolicyError):
    """--attention-backend flash where flash-attn-4 cannot run exactly; one line saying why."""


def backend_mode(attention_backend) -> str:
    """Megatron's --attention-backend (an AttnBackend or its name) as "auto", "flash" or "sdpa"."""
    name = attention_backend.name if isinstance(attention_backend, AttnBackend) else str(attention_backend)
    if name not in AttnBackend.__members__:
        raise AttentionKernelError(f"--attention-backend {name}: use one of {', '.join(AttnBackend.__members__)}")
    return {"auto": "auto", "flash": "flash"}.get(name, "sdpa")


def kernel_mode(env: str, environ=os.environ, modes: tuple[str, ...] = KERNEL_MODES) -> str:
    """The variable `env`'s value ("auto" where unset); KernelModeError for one not in `modes`."""
    mode = environ.get(env, "auto") or "auto"
    if mode not in modes:
        raise KernelModeError(f"{env}={mode}: use one of {', '.join(modes)}")
    return mode


def extra_head_dims(environ=os.environ) -> tuple[int, ...]:
    """CHECKED_ENV's head dims ("64,96,128"); KernelPolicyError for another value."""
    text = environ.get(CHECKED_ENV, "").replace(",", " ")
    if not all(part.isdigit() and int(part) > 0 for part in text.split()):
        raise KernelPolicyError(f"{CHECKED_ENV}={environ[CHECKED_ENV]}: give head dims as positive integers, "
                                f"e.g. 64,96,128")
    return tuple(sorted({int(part) for part in text.split()}))


def _flag(environ, env: str) -> bool:
    value = environ.get(env, "")
    if value not in ("", "0", "1"):
        raise KernelPolicyError(f"{env}={value}: use 1 or 0")
    return value == "1"


@dataclass(frozen=True)
class KernelPolicy:
    """attention: backend_mode of --attention-backend; flash_attention_version: Megatron's flag (FA4
    only where None or 4); transformer_impl: Megatron's flag (local: no Transformer Engine layers
    even where it imports); norm, mlp: KERNEL_MODES; fa4_head_dims: head dims added to CHECKED_HEAD_DIMS;
    cudnn_merge: merged chunks count as checked on this GPU; eager_rope: upstream's RoPE; experts:
    EXPERTS_MODES."""

    attention: str = "auto"
    flash_attention_version: int | None = None
    transformer_impl: str = "transformer_engine"
    norm: str = "auto"
    mlp: str = "auto"
    fa4_head_dims: tuple[int, ...] = ()
    cudnn_merge: bool = False
    eager_rope: bool = False
    experts: str = "auto"

    @property
    def te(self) -> bool:
        """Transformer Engine's layers: where it imports and --transformer-impl asks for them."""
        return HAVE_TE and self.transformer_impl != "local"

    def __str__(self) -> str:
        return (f"attention {self.attention}, norms {self.norm}, MLPs {self.mlp}, "
                f"RoPE {'eager' if self.eager_rope else 'fused'}, Transformer Engine {'on' if self.te else 'off'}, "
                f"experts {self.experts}")


def build(attention_backend="auto", flash_attention_version=None, transformer_impl="transformer_engine",
          environ=os.environ) -> KernelPolicy:
    """The policy of these flags and overrides; KernelPolicyError (one line) for a bad value."""
    if str(getattr(attention_backend, "name", attention_backend)) == "local":
        raise KernelPolicyError("--attention-backend local is Megatron's switch to its --spec local models; for "
                                "torch SDPA in these layers use --attention-backend unfused")
    return KernelPolicy(backend_mode(attention_backend), flash_attention_version,
                        transformer_impl, kernel_mode(NORM_KERNEL_ENV, environ),
                        kernel_mode(MLP_KERNEL_ENV, environ), extra_head_dims(environ),
                        _flag(environ, CUDNN_MERGE_ENV), _flag(environ, EAGER_ROPE_ENV),
                        experts=kernel_mode(EXPERTS_KERNEL_ENV, environ, EXPERTS_MODES))


_installed: KernelPolicy | None = None


def install(policy: KernelPolicy) -> bool:
    """Make `policy` the process's; whether it is new (a first or a changed one)."""
    global _installed
    new, _installed = policy != _installed, policy
    return new


def current() -> KernelPolicy:
    """The installed policy; before one is (layers built without Megatron's arguments), the defaults
    with this environment's overrides."""
    return _installed if _installed is not None else build()
