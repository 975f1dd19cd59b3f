"""The optimizer megatron.training steps in a heterogeneous run: megatron-core's MimoOptimizer (one
optimizer per trainable module, one global gradient-norm clip) with checkpoint state that loads under
any other layout.

A module's optimizer state in a checkpoint is its megatron-core sharded state (per-parameter state
keyed by the model's layout-independent tensors: Adam moments, and with the distributed optimizer its
main weights in the `fully_reshardable` model-space format) plus what megatron-core keeps as "common"
state (the step count, the parameter groups' hyperparameters, the loss scaler). Megatron writes
common state from rank 0 alone, which may not hold the module: here it travels as one sharded
object per module, written by the module's first rank and read by all of its ranks. Parameter-group
membership is always this run's own (a pipeline stage's parameters depend on the layout).
"""

import torch
from megatron.core.dist_checkpointing.dict_utils import merge
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.utils import extract_sharded_base
from megatron.core.models.mimo.optimizer import MimoOptimizer
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_hetero.parallel.parallel_state import pointed_at

COMMON = "common"  # a module's common optimizer state, one sharded object


def _replica_id(pgs: ProcessGroupCollection) -> tuple:
    """Main replica (all zeros) on exactly one rank of the module: its first."""
    return tuple(group.rank() for group in (pgs.tp, pgs.cp, pgs.dp, pgs.pp))


def _own_param_groups(loaded, current) -> None:
    """Every `param_groups` list in `loaded` takes the parameter ids of the same list in `current`
    (the state dict of this run's optimizer, the same nesting)."""
    if isinstance(loaded, dict):
        for key, value in loaded.items():
            if key == "param_groups":
                if len(value) != len(current[key]):
                    raise ValueError(f"the checkpoint has {len(value)} optimizer parameter groups, this run "
                                     f"{len(current[key])}: the optimizer flags (weight decay, lr multipliers) differ")
                for saved, own in zip(value, current[key]):
                    if "params" in own:  # the distributed optimizer maps its groups itself
                        saved["params"] = own["params"]
            elif key in current:
                _own_param_groups(value, current[key])
    elif isinstance(loaded, list) and isinstance(current, list):
        for saved, own in zip(loaded, current):
            _own_param_groups(saved, own)


def _distributed_to_plain(common: dict) -> None:
    """The distributed optimizer's common state (its parameter groups under `optimizer`, each with
    the step) as megatron-core's fp32 optimizer keeps it (torch's `param_groups`, the step as
    `state.common_step`): its per-parameter state has the same keys in both (`fully_reshardable`)."""
    groups = common.pop("optimizer")["param_groups"]
    common.pop("param_state_sharding_type", None)
    steps = {group.pop("step") for group in groups if "step" in group}
    assert len(steps) <= 1, steps
    common["param_groups"] = groups
    if steps:  # torch's Adam keeps it as a tensor
        common.setdefault("state", {})["common_step"] = torch.tensor(float(steps.pop()))


class HeteroOptimizer(MimoOptimizer):
    """MimoOptimizer whose checkpoint state reshards (see the module docstring). `primary`: the
    groups megatron-core's parallel_state answers with on this rank outside checkpoint building.
    `fresh`: modules that take no state from the checkpoint being loaded (trained now, frozen when it
    was saved); their optimizers start anew."""

    def __init__(self, module_infos, config, primary: ProcessGroupCollection):
        super().__init__(module_infos, config)
        self.primary = primary
        self.fresh: set[str] = set()

    def _stateful(self):
        return [(name, info) for name, info in self.module_infos.items()
                if info.is_active and info.optimizer is not None and name not in self.fresh]

    def sharded_state_dict(self, model_sharded_state_dict, is_loading: bool = False, metadata=None, **kwargs):
        out = {}
        for name, info in self._stateful():
            pgs = info.pg_collection
            with pointed_at(pgs, self.primary):
                state = info.optimizer.sharded_state_dict(
                    model_sharded_state_dict, is_loading, metadata={**(metadata or {}), "dp_cp_group": pgs.dp_cp},
                    **kwargs)
            sharded, common = extract_sharded_base(state)
            sharded[COMMON] = ShardedObject(f"optimizer.{name}.common", common, (1,), (0,),
                                            replica_id=_replica_id(pgs))
            out[name] = sharded
        return out

    def load_state_dict(self, state_dict):
        for name, info in self._stateful():
            loaded = state_dict[name]
            common = loaded.pop(COMMON)
            current = info.optimizer.state_dict()
            if "optimizer" in common and "optimizer" not in current:
                _distributed_to_plain(common)
            merge(loaded, common)
            _own_param_groups(loaded, current)
            info.optimizer.load_state_dict(loaded)
