"""Which kernels the layers may run: a frozen KernelPolicy of Megatron's `--attention-backend`,
`--flash-attention-version` and `--transformer-impl` and the documented overrides below (the only
place they are read). The flags are validated with the arguments (patches/arguments.py: `build`, so
every entry script stops on a bad value with the same line) and reach every module's
TransformerConfig as its fields of the same names (training/providers.py); a layer takes the policy
of its config (`of(config)`). Per call the layers still decide by shape and device
(attention_kernels.choose_kernel, quack_kernels.choose_quack); the policy fixes what they decide among.

Overrides (environment variables):
- MEGATRON_HETERO_NORM_KERNEL, MEGATRON_HETERO_MLP_KERNEL: auto (default), torch or quack;
- MEGATRON_HETERO_EXPERTS_KERNEL: auto (default), grouped or sequential: an MoE layer's experts on
  grouped GEMMs or megatron-core's SequentialMLP loop (models/experts.py);
- MEGATRON_HETERO_LOSS_KERNEL: auto (default), torch or quack: the LLM's fused loss on quack's cross
  entropy (auto: on GPUs whose `megatron-hetero kernels check loss` passed) or megatron-core's
  (models/loss_kernels.py);
- MEGATRON_HETERO_SHORT_ATTENTION: auto (default), torch or triton: a packed call whose segments are all
  short (Qwen2.5-VL's windows) on our Triton kernel (models/short_attention.py; auto: on GPUs whose
  `megatron-hetero kernels check attention` passed it) or torch's varlen flash-attention;
- MEGATRON_HETERO_RESIDUAL_ADD: auto (default), triton or torch: a layer's fused bias-dropout-add
  without dropout, InternViT's with layer scale too, on our Triton kernel (models/residual_add.py; auto
  and triton, on GPUs with Triton) or the compiled function (torch);
- MEGATRON_HETERO_BIAS_GELU: auto (default), torch or triton: a dense MLP's fc1 bias and erf GELU where
  megatron-core's forward runs the MLP on our Triton kernel (models/bias_gelu.py; auto and triton, on
  GPUs with Triton) or the compiled function (torch);
- MEGATRON_HETERO_ATTENTION_INPUT: auto (default), torch or triton: the packed ViTs' attention input (QKV
  bias, split, RoPE, padding) and the padding's cut after the attention on our Triton kernels
  (models/attention_input.py; triton, on GPUs with Triton) or the compiled functions (auto, torch);
- MEGATRON_HETERO_SMALL_NORM: auto (default), torch or triton: the norm calls quack does not take (below
  its minimum, or quack absent) on our Triton kernels (models/small_norm.py; triton, on GPUs with Triton)
  or torch's (auto, torch);
- MEGATRON_HETERO_EMBEDDING_GRAD: auto (default) or torch: the input embedding's weight gradient added
  into main_grad by its backward on GPUs, or upstream's dense gradient (models/embedding.py);
- MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS: head dims ("64,96,128") just checked on this GPU by
  `megatron-hetero kernels check attention`, added to the table;
- MEGATRON_HETERO_CUDNN_MERGE_CHECKED=1: this GPU passed `megatron-hetero kernels check cp-chunks`;
- MEGATRON_HETERO_EAGER_ROPE=1: upstream's unfused RoPE (patches/rope.py), to compare;
- MEGATRON_HETERO_KERNEL_CHECKS: the user's table file (default ~/.cache/megatron_hetero/kernel_checks.json).

The checked tables (FA4 head dims, merged-chunk GPUs, quack-loss GPUs and short-segment GPUs by
torch.cuda.get_device_name()) are kernel_checks.json beside this file, shipped with the package, with
the user's table merged over it: the kernel checks write their passing results there (`--record`:
record_check), since an installed package's own files may be read-only and a reinstall replaces them.
"""

import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from megatron.core.transformer.enums import AttnBackend

from megatron_hetero.models.accelerators import imports

HAVE_TE = imports("transformer_engine")

NORM_KERNEL_ENV = "MEGATRON_HETERO_NORM_KERNEL"
MLP_KERNEL_ENV = "MEGATRON_HETERO_MLP_KERNEL"
EXPERTS_KERNEL_ENV = "MEGATRON_HETERO_EXPERTS_KERNEL"
LOSS_KERNEL_ENV = "MEGATRON_HETERO_LOSS_KERNEL"
EMBEDDING_GRAD_ENV = "MEGATRON_HETERO_EMBEDDING_GRAD"
SHORT_ATTENTION_ENV = "MEGATRON_HETERO_SHORT_ATTENTION"
RESIDUAL_ADD_ENV = "MEGATRON_HETERO_RESIDUAL_ADD"
BIAS_GELU_ENV = "MEGATRON_HETERO_BIAS_GELU"
ATTENTION_INPUT_ENV = "MEGATRON_HETERO_ATTENTION_INPUT"
SMALL_NORM_ENV = "MEGATRON_HETERO_SMALL_NORM"
CHECKED_ENV = "MEGATRON_HETERO_FA4_CHECKED_HEAD_DIMS"
CUDNN_MERGE_ENV = "MEGATRON_HETERO_CUDNN_MERGE_CHECKED"
EAGER_ROPE_ENV = "MEGATRON_HETERO_EAGER_ROPE"
KERNEL_MODES = ("auto", "torch", "quack")
EXPERTS_MODES = ("auto", "grouped", "sequential")
EMBEDDING_GRAD_MODES = ("auto", "torch")
TRITON_MODES = ("auto", "torch", "triton")  # a choice between torch's (or compiled) functions and our Triton kernels


class KernelPolicyError(ValueError):
    """A kernel flag or override that cannot work; one line naming it and the fix."""


class KernelModeError(KernelPolicyError):
    """A kernel environment variable whose value is not a mode; one line saying which are."""


class AttentionKernelError(KernelPolicyError):
    """--attention-backend flash where flash-attn-4 cannot run exactly; one line saying why."""


CHECKS_FILE = Path(__file__).with_name("kernel_checks.json")
USER_CHECKS_ENV = "MEGATRON_HETERO_KERNEL_CHECKS"
# The tables' lists of GPU models on which a kernel passed its check: context parallelism's merged-chunk
# cuDNN attention (`kernels check cp-chunks`), quack's cross entropy for the loss (`kernels check loss`),
# our Triton kernel for short segments (`kernels check attention`), quack's GEMM epilogues for a gated MLP
# with fc1 biases (`kernels check mlp`).
GPU_LISTS = ("cudnn_merge_checked", "quack_loss_checked", "short_attention_checked", "gated_bias_mlp_checked")


def user_checks_file(environ=os.environ) -> Path:
    """The user's table: USER_CHECKS_ENV's path, else ~/.cache/megatron_hetero/kernel_checks.json."""
    return Path(environ.get(USER_CHECKS_ENV) or Path.home() / ".cache" / "megatron_hetero" / "kernel_checks.json")


def _read(path: Path) -> dict:
    """A table file (empty where the file does not exist; a GPU list that an older table lacks, empty);
    KernelPolicyError (one line) for another."""
    try:
        checks = json.loads(path.read_text()) if path.is_file() else {"fa4_checked_head_dims": {}}
        return dict(fa4_checked_head_dims=dict(checks["fa4_checked_head_dims"]),
                    **{key: list(checks.get(key, [])) for key in GPU_LISTS})
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise KernelPolicyError(f"{path}: not a kernel checks table ({error}); fix or delete it "
                                f"(`megatron-hetero kernels check --record` writes it)") from None


def load_checks(*paths: Path) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[str, ...]]]:
    """(FA4 head dims by GPU, each of GPU_LISTS' GPUs) of the tables in `paths` merged in order: a later
    table's entry for a GPU replaces an earlier one's; a list's GPUs of every table."""
    dims, lists = {}, {key: [] for key in GPU_LISTS}
    for checks in map(_read, paths):
        dims.update((gpu, tuple(entry)) for gpu, entry in checks["fa4_checked_head_dims"].items())
        for key, gpus in lists.items():
            gpus += [gpu for gpu in checks[key] if gpu not in gpus]
    return dims, {key: tuple(gpus) for key, gpus in lists.items()}


def _tables(environ=os.environ) -> tuple[tuple[dict, dict], str | None]:
    """The shipped table with the user's merged over it, and None; where the user's is not a table,
    the shipped one alone and the problem, which `build` reports as one line when the arguments are
    checked (not as an import error)."""
    try:
        return load_checks(CHECKS_FILE, user_checks_file(environ)), None
    except KernelPolicyError as error:
        return load_checks(CHECKS_FILE), str(error)


(CHECKED_HEAD_DIMS, _GPU_LISTS), USER_CHECKS_PROBLEM = _tables()
CUDNN_MERGE_CHECKED = _GPU_LISTS["cudnn_merge_checked"]
QUACK_LOSS_CHECKED = _GPU_LISTS["quack_loss_checked"]
SHORT_ATTENTION_CHECKED = _GPU_LISTS["short_attention_checked"]
GATED_BIAS_MLP_CHECKED = _GPU_LISTS["gated_bias_mlp_checked"]


def record_check(gpu: str, fa4_head_dims: tuple[int, ...] | None = None, cudnn_merge: bool = False,
                 quack_loss: bool = False, short_attention: bool = False, gated_bias_mlp: bool = False,
                 path: Path | None = None) -> Path:
    """A kernel check's passing result into a table (the user's, unless `path`): `gpu`'s FA4 head dims
    (`kernels check attention`), `gpu` among the merged-chunk GPUs (`kernels check cp-chunks`), among
    the quack-loss GPUs (`kernels check loss`), among the short-segment GPUs (`kernels check attention`),
    among the biased gated MLP's GPUs (`kernels check mlp`). The file written."""
    path = path or user_checks_file()
    checks = _read(path)
    if fa4_head_dims is not None:
        checks["fa4_checked_head_dims"][gpu] = sorted(fa4_head_dims)
    for key, passed in zip(GPU_LISTS, (cudnn_merge, quack_loss, short_attention, gated_bias_mlp), strict=True):
        if passed and gpu not in checks[key]:
            checks[key].append(gpu)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(checks, indent=2) + "\n")
    return path


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
class ModeOverride:
    """One environment variable choosing among `modes` for KernelPolicy's field `field`; `label` names it
    in the policy's one-line summary."""

    field: str
    env: str
    modes: tuple[str, ...]
    label: str


# The kernel modes' variables, one row each: KernelPolicy has a field of each row's name, read by _policy
# and written by __str__ in this order.
MODE_OVERRIDES = (
    ModeOverride("norm", NORM_KERNEL_ENV, KERNEL_MODES, "norms"),
    ModeOverride("mlp", MLP_KERNEL_ENV, KERNEL_MODES, "MLPs"),
    ModeOverride("experts", EXPERTS_KERNEL_ENV, EXPERTS_MODES, "experts"),
    ModeOverride("loss", LOSS_KERNEL_ENV, KERNEL_MODES, "loss"),
    ModeOverride("embedding_grad", EMBEDDING_GRAD_ENV, EMBEDDING_GRAD_MODES, "embedding gradient"),
    ModeOverride("short_attention", SHORT_ATTENTION_ENV, TRITON_MODES, "short segments"),
    ModeOverride("residual_add", RESIDUAL_ADD_ENV, TRITON_MODES, "residual add"),
    ModeOverride("bias_gelu", BIAS_GELU_ENV, TRITON_MODES, "bias GELU"),
    ModeOverride("attention_input", ATTENTION_INPUT_ENV, TRITON_MODES, "attention input"),
    ModeOverride("small_norm", SMALL_NORM_ENV, TRITON_MODES, "small norms"),
)


@dataclass(frozen=True)
class KernelPolicy:
    """attention: backend_mode of --attention-backend; flash_attention_version: Megatron's flag (FA4
    only where None or 4); transformer_impl: Megatron's flag (local: no Transformer Engine layers
    even where it imports); fa4_head_dims: head dims added to CHECKED_HEAD_DIMS; cudnn_merge: merged
    chunks count as checked on this GPU; eager_rope: upstream's RoPE; each MODE_OVERRIDES row's field:
    one of that row's modes."""

    attention: str = "auto"
    flash_attention_version: int | None = None
    transformer_impl: str = "transformer_engine"
    norm: str = "auto"
    mlp: str = "auto"
    fa4_head_dims: tuple[int, ...] = ()
    cudnn_merge: bool = False
    eager_rope: bool = False
    experts: str = "auto"
    loss: str = "auto"
    embedding_grad: str = "auto"
    short_attention: str = "auto"
    residual_add: str = "auto"
    bias_gelu: str = "auto"
    attention_input: str = "auto"
    small_norm: str = "auto"

    @property
    def te(self) -> bool:
        """Transformer Engine's layers: where it imports and --transformer-impl asks for them."""
        return HAVE_TE and self.transformer_impl != "local"

    def __str__(self) -> str:
        modes = ", ".join(f"{row.label} {getattr(self, row.field)}" for row in MODE_OVERRIDES)
        return (f"attention {self.attention}, RoPE {'eager' if self.eager_rope else 'fused'}, "
                f"Transformer Engine {'on' if self.te else 'off'}, {modes}")


OVERRIDE_ENVS = (CHECKED_ENV, CUDNN_MERGE_ENV, EAGER_ROPE_ENV, *(row.env for row in MODE_OVERRIDES))
_ROW_OF = {row.field: row for row in MODE_OVERRIDES}


def mode_now(field: str, environ=os.environ) -> str:
    """The mode of MODE_OVERRIDES' row for KernelPolicy's `field` in `environ`: for calls that have no
    config at hand to take the policy of (read at each call, a dictionary lookup)."""
    row = _ROW_OF[field]
    return kernel_mode(row.env, environ, row.modes)


@functools.lru_cache(maxsize=64)
def _policy(attention_backend, flash_attention_version, transformer_impl, overrides: tuple) -> KernelPolicy:
    # `overrides`: OVERRIDE_ENVS' values (None where unset), so that the cache key is the environment's.
    environ = {env: value for env, value in zip(OVERRIDE_ENVS, overrides) if value is not None}
    return KernelPolicy(backend_mode(attention_backend), flash_attention_version, transformer_impl,
                        fa4_head_dims=extra_head_dims(environ), cudnn_merge=_flag(environ, CUDNN_MERGE_ENV),
                        eager_rope=_flag(environ, EAGER_ROPE_ENV),
                        **{row.field: kernel_mode(row.env, environ, row.modes) for row in MODE_OVERRIDES})


def of(config, environ=os.environ) -> KernelPolicy:
    """The policy of the layers built from `config` (a TransformerConfig, or Megatron's arguments):
    its attention_backend, flash_attention_version and transformer_impl with `environ`'s overrides;
    KernelPolicyError (one line) for a bad override."""
    return _policy(config.attention_backend, config.flash_attention_version, config.transformer_impl,
                   tuple(environ.get(env) for env in OVERRIDE_ENVS))


def build(attention_backend="auto", flash_attention_version=None, transformer_impl="transformer_engine",
          environ=os.environ) -> KernelPolicy:
    """The policy of these flags and overrides, checked as flags; KernelPolicyError (one line) for a
    bad value (a corrupt table of the user's checked kernels too)."""
    if USER_CHECKS_PROBLEM:
        raise KernelPolicyError(USER_CHECKS_PROBLEM)
    if str(getattr(attention_backend, "name", attention_backend)) == "local":
        raise KernelPolicyError("--attention-backend local is Megatron's switch to its --spec local models; for "
                                "torch SDPA in these layers use --attention-backend unfused")
    flags = SimpleNamespace(attention_backend=attention_backend, flash_attention_version=flash_attention_version,
                            transformer_impl=transformer_impl)
    return of(flags, environ)
