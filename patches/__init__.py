"""megatron-hetero's changes to megatron-core and megatron.training, one module per concern.

Installed as `megatron_hetero.patches`. `apply()` installs every patch (idempotent); the launcher
(`python -m megatron_hetero.launch SCRIPT.py ...`) calls it before running the script, and scripts
that import megatron_hetero themselves call it first:

    import megatron_hetero.patches
    megatron_hetero.patches.apply()

Without `--hetero-layout` the patched functions behave as upstream's (the CPU ones apart, which
only act where no GPU is present).
"""

from megatron_hetero.patches import quiet

quiet.install()  # before megatron-core is imported

from megatron_hetero.patches import (  # noqa: E402
    arguments,
    checkpointing,
    cpu,
    faults,
    fused_adam,
    grad_accum_fusion,
    grad_sync,
    hetero_data,
    hetero_init,
    hetero_model,
    hetero_optimizer,
    hetero_schedule,
    layer_specs,
    metrics,
    rerun,
    rope,
    startup,
    torch_adam,
)
from megatron_hetero.patches._patch import PatchError, check_version  # noqa: E402


def apply() -> None:
    startup.set_cuda_connections()  # before CUDA starts
    check_version()
    startup.apply()
    arguments.apply()
    cpu.apply()
    hetero_init.apply()
    hetero_model.apply()
    hetero_optimizer.apply()
    hetero_data.apply()
    hetero_schedule.apply()
    checkpointing.apply()
    torch_adam.apply()
    grad_sync.apply()
    metrics.apply()
    faults.apply()
    rerun.apply()
    layer_specs.apply()
    rope.apply()
    grad_accum_fusion.apply()
    fused_adam.apply()


__all__ = ["apply", "PatchError"]
