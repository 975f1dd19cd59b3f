"""The distributed optimizer's fully reshardable checkpoints with torch's Adam (megatron-core 0.19
`DistributedOptimizer._set_main_param_and_optimizer_states`), i.e. without Transformer Engine or apex.

torch's Adam keeps a tensor `step` in each parameter's state. Loading a `fully_reshardable`
checkpoint copies every tensor of that state from the checkpoint's per-parameter tensors, which hold
no `step` (the format stores it once, with the parameter groups, and load_state_dict has already
set it): upstream then fails with KeyError 'step' (FusedAdam keeps no per-parameter step, so
upstream's usual set-up never meets it). The copy skips what the checkpoint does not hold per
parameter: the step.
"""

from megatron_hetero.patches._patch import replace


def _set_states(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        return original(self, model_param, tensors if "step" in tensors else {"step": None, **tensors})
    return _set_main_param_and_optimizer_states


def apply() -> None:
    replace("megatron.core.optimizer.distrib_optimizer.DistributedOptimizer._set_main_param_and_optimizer_states",
            _set_states, params=("self", "model_param", "tensors"))
