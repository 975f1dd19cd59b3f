"""torch's fused Adam kernel where megatron-core falls back to torch's Adam (megatron-core 0.19
`optimizer._get_megatron_optimizer_based_on_param_groups`: without Transformer Engine or apex it
builds torch.optim.Adam / AdamW with torch's default, the foreach implementation).

The foreach implementation runs a dozen passes over the fp32 main params and Adam states per step;
the fused one reads and writes each once, as apex's and TE's FusedAdam do (docs/runs/benchmarks.md:
`tools/bench_ops.py` on W1's parameters). Same update rule; the fused kernel rounds differently in
the last bits. Only where every parameter is on a GPU (CPU runs keep the foreach path); a checkpoint
loaded later keeps it fused (torch's load_state_dict takes the saved groups' flags).
"""

import torch

from megatron_hetero.patches._patch import replace

# Where the fused kernel replaces foreach. torch has one for CPUs too; CPU runs keep the foreach path
# (the tests' references), so that a CPU run's numbers do not change with this patch.
DEVICE_TYPES = ("cuda",)


def use_fused(optimizer: torch.optim.Adam) -> None:
    """Switch a torch Adam/AdamW to its fused kernel if every parameter is on a GPU."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not params or not all(p.device.type in DEVICE_TYPES and p.is_floating_point() for p in params):
        return
    for settings in (optimizer.defaults, *optimizer.param_groups):
        settings["fused"], settings["foreach"] = True, False
    optimizer._step_supports_amp_scaling = True  # as torch's constructor sets it for fused
    for param, state in optimizer.state.items():  # a state loaded from a foreach run: its step on the CPU
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].to(param.device, torch.float32)


def _fused(original):
    def _get_megatron_optimizer_based_on_param_groups(config, model_chunks, param_groups, *args, **kwargs):
        built = original(config, model_chunks, param_groups, *args, **kwargs)
        inner = built[0] if isinstance(built, tuple) else getattr(built, "optimizer", None)
        if isinstance(inner, torch.optim.Adam):
            use_fused(inner)
            inner.register_load_state_dict_post_hook(use_fused)
        return built
    return _get_megatron_optimizer_based_on_param_groups


def apply() -> None:
    replace("megatron.core.optimizer._get_megatron_optimizer_based_on_param_groups", _fused,
            params=("config", "model_chunks", "param_groups"))
