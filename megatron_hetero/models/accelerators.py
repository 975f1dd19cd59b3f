"""Which accelerator libraries this environment has (Transformer Engine, apex, Triton): the one probe
that the kernel policy (kernel_policy.py), the Triton kernels and the patches read. Plain Python, no
megatron-core import: the patches probe before megatron-core is imported (patches/quiet.py), and
the commands drop its warnings about them first."""

import importlib
import importlib.util
import warnings

# megatron-core warns that TE/apex are missing once per importing module (about 40 lines a process).
_MISSING_WARNINGS = (r".*(Transformer Engine and Apex are not installed|Apex is not installed"
                     r"|Only transformer-engine>=\S+ supports)")


def installed(module: str) -> bool:
    """Whether `module` is installed (found, not imported)."""
    return importlib.util.find_spec(module) is not None


def imports(module: str) -> bool:
    """Whether `module` imports here (installed and loadable: a Transformer Engine built for another
    CUDA is installed but does not import)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def has_te() -> bool:
    return installed("transformer_engine")


def has_apex() -> bool:
    return installed("apex")


def has_triton() -> bool:
    """Whether Triton imports here (the short-segment attention and the gated MLP's halves copy run on it)."""
    return imports("triton")


def ignore_missing_warnings() -> None:
    """Drop megatron-core's warnings that TE/apex are missing; called before megatron-core is
    imported (the commands, patches/quiet.py, which prints one line instead)."""
    warnings.filterwarnings("ignore", message=_MISSING_WARNINGS, category=UserWarning)
