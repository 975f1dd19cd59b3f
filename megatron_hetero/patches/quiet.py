"""One line per run, on rank 0, instead of megatron-core's dozens of "Transformer Engine / Apex not
installed" warnings (one per importing module and process). Installed before megatron-core is imported."""

import os
import warnings

from megatron_hetero.models.accelerators import ignore_missing_warnings, installed


def install() -> None:
    ignore_missing_warnings()
    warnings.filterwarnings("ignore", message="MimoModelConfig is experimental", category=UserWarning)
    missing = [name for name, module in (("Transformer Engine", "transformer_engine"), ("apex", "apex"))
               if not installed(module)]
    if missing and int(os.environ.get("RANK", "0")) == 0:
        print(f"megatron-hetero: {' and '.join(missing)} not installed: using torch and megatron-core's "
              f"local kernels, megatron-hetero's layers", flush=True)
