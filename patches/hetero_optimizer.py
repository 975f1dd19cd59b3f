"""Per-module optimizers and one global gradient-norm clip (megatron.training 0.19 calls
`get_megatron_optimizer(config, model_chunks, ...)`).

With a HeteroModel, each trainable module this rank holds gets megatron-core's own optimizer over its
DDP chunk and groups; megatron-core's MimoOptimizer chains them: the gradient norm is global over
every module (each module's norm over its own model-parallel groups, then shared over the world),
every module is clipped by it and stepped.
"""

import contextlib

import torch.distributed as dist
from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

from megatron_hetero.patches._patch import replace
from megatron_hetero.runtime.model import HeteroModel


@contextlib.contextmanager
def _world_gathers_over(group):
    """megatron-core aligns an optimizer's parameter groups over the world (all_gather_object into a
    world-sized list, optimizer/__init__.py:363), but only a module's ranks build its optimizer (a
    frozen module's none): such gathers run over `group`, the list filled up with this rank's
    entry."""
    gather = dist.all_gather_object

    def gather_over_group(object_list, obj, group_=None):
        if group_ is not None:
            return gather(object_list, obj, group=group_)
        gathered = [None] * dist.get_world_size(group)
        gather(gathered, obj, group=group)
        object_list[:] = gathered + [obj] * (len(object_list) - len(gathered))

    dist.all_gather_object = gather_over_group
    try:
        yield
    finally:
        dist.all_gather_object = gather


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
                with _world_gathers_over(module.pgs.intra_dist_opt):
                    optimizer = original(config, [module.ddp], *args, pg_collection=module.pgs, **kwargs)
            infos[name] = ModuleOptimizerInfo(optimizer, module.groups.grid, module.pgs, optimizer is not None)
        run = model_chunks[0].run
        run.optimizer = MimoOptimizer(infos, config)
        return run.optimizer
    return get_megatron_optimizer


def apply() -> None:
    replace("megatron.training.training.get_megatron_optimizer", _get_megatron_optimizer,
            params=("config", "model_chunks", "pg_collection"))
