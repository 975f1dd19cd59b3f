"""Per-module optimizers and one global gradient-norm clip (megatron.training 0.19 calls
`get_megatron_optimizer(config, model_chunks, ...)`).

With a HeteroModel, each trainable module this rank holds gets megatron-core's own optimizer over its
DDP chunk and groups; megatron-core's MimoOptimizer chains them: the gradient norm is global over
every module (each module's norm over its own model-parallel groups, then shared over the world),
every module is clipped by it and stepped (runtime/optimizer.py: with checkpoint state that reshards).

megatron-core aligns an optimizer's parameter groups over the whole world (`_get_param_groups`
all-gathers their keys over the default group): that collective then pairs different modules'
builds, and hangs where a rank builds none (a non-colocated frozen encoder). While a module's
optimizer is built, the alignment runs over that module's ranks.
"""

import contextlib

from megatron.core.models.mimo.optimizer import ModuleOptimizerInfo

from megatron_hetero.patches._patch import replace, temporarily
from megatron_hetero.runtime.model import HeteroModel
from megatron_hetero.runtime.optimizer import HeteroOptimizer


def _param_groups_aligned_within(group):
    """megatron-core's `_get_param_groups` with its world collectives taken over `group`."""
    def within(get_param_groups):
        def get_param_groups_within(*args, **kwargs):
            with contextlib.ExitStack() as stack:
                stack.enter_context(temporarily(
                    "torch.distributed.get_world_size", lambda size: lambda group_=None: size(group_ or group),
                    ("group",)))
                stack.enter_context(temporarily(
                    "torch.distributed.all_gather_object",
                    lambda gather: lambda out, obj, group_=None: gather(out, obj, group=group_ or group),
                    ("object_list", "obj", "group")))
                return get_param_groups(*args, **kwargs)
        return get_param_groups_within
    return temporarily("megatron.core.optimizer._get_param_groups", within,
                       ("model_chunks", "config", "config_overrides"))


def _get_megatron_optimizer(original):
    def get_megatron_optimizer(config, model_chunks, *args, **kwargs):
        if not (model_chunks and isinstance(model_chunks[0], HeteroModel)):
            return original(config, model_chunks, *args, **kwargs)
        kwargs.pop("pg_collection", None)
        kwargs["use_gloo_process_groups"] = False  # upstream takes them from parallel_state only
        infos = {}
        for name, module in model_chunks[0].run.modules.items():
            optimizer = None
            if module.ddp is not None:
                with _param_groups_aligned_within(module.pgs.intra_dist_opt):
                    optimizer = original(config, [module.ddp], *args, pg_collection=module.pgs, **kwargs)
            infos[name] = ModuleOptimizerInfo(optimizer, module.groups.grid, module.pgs, optimizer is not None)
        run = model_chunks[0].run
        run.handles.optimizer = HeteroOptimizer(infos, config, run.primary.pgs)
        return run.handles.optimizer
    return get_megatron_optimizer


def apply() -> None:
    replace("megatron.training.training.get_megatron_optimizer", _get_megatron_optimizer,
            params=("config", "model_chunks", "pg_collection"))
