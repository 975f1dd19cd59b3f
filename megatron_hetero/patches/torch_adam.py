"""megatron-core's distributed-optimizer checkpoints with torch's Adam, i.e. without Transformer
Engine or apex (megatron-core 0.19 `DistributedOptimizer.sharded_state_dict` and
`_set_main_param_and_optimizer_states`). Upstream's usual set-up has FusedAdam, which keeps no
per-parameter step; torch's Adam does, and two load paths then fail:

- Building the state dict to load into (Megatron loads before the first step) calls `state_dict()`,
  which reads the step from the optimizer's per-parameter state and asserts there is one: a fresh
  optimizer has none. It gets its states first, as upstream does for other formats
  (`_init_optimizer_states_with_dummy_values`: one zero-gradient step on the main parameters; the
  load then overwrites them and every state).
- Loading a `fully_reshardable` checkpoint copies every tensor of a parameter's state from the
  checkpoint's per-parameter tensors, which hold no step (the format stores it once, with the
  parameter groups, and load_state_dict has already set it): KeyError 'step'. The copy skips it.
- load_state_dict gives every parameter's state the same step tensor object, which torch's Adam
  then increments in place once per parameter: every later step's bias correction is wrong. Each
  parameter gets its own copy.
"""

import torch

from megatron_hetero.patches._patch import replace


def _sharded_state_dict(original):
    def sharded_state_dict(self, model_sharded_state_dict=None, is_loading=False, *args, **kwargs):
        from megatron.core.optimizer import distrib_optimizer

        if is_loading and not distrib_optimizer.HAVE_APEX_OR_TE and not self.optimizer.state:
            self._init_optimizer_states_with_dummy_values()
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)
    return sharded_state_dict


def _set_states(original):
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        return original(self, model_param, tensors if "step" in tensors else {"step": None, **tensors})
    return _set_main_param_and_optimizer_states


def _load_state_dict(original):
    def load_state_dict(self, state_dict):
        original(self, state_dict)
        for state in self.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()
    return load_state_dict


def apply() -> None:
    owner = "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer"
    replace(f"{owner}.sharded_state_dict", _sharded_state_dict,
            params=("self", "model_sharded_state_dict", "is_loading"))
    replace(f"{owner}.load_state_dict", _load_state_dict, params=("self", "state_dict"))
    replace(f"{owner}._set_main_param_and_optimizer_states", _set_states, params=("self", "model_param", "tensors"))
