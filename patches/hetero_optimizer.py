"""Per-module optimizers and one global gradient-norm clip (megatron.training 0.19 calls
`get_megatron_optimizer(config, model_chunks, ...)`).

With a HeteroModel, each trainable module this rank holds gets megatron-core's own optimizer over its
DDP chunk and groups; megatron-core's MimoOptimizer chains them: the gradient norm is global over
every module (each module's norm over its own model-parallel groups, then shared over the world),
every module is clipped by it and stepped.
"""

from megatron.core.models.mimo.optimizer import MimoOptimizer, ModuleOptimizerInfo

from megatron_hetero.patches._patch import replace
from megatron_hetero.runtime.model import HeteroModel


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
                optimizer = original(config, [module.ddp], *args, pg_collection=module.pgs, **kwargs)
            infos[name] = ModuleOptimizerInfo(optimizer, module.groups.grid, module.pgs, optimizer is not None)
        run = model_chunks[0].run
        run.optimizer = MimoOptimizer(infos, config)
        return run.optimizer
    return get_megatron_optimizer


def apply() -> None:
    replace("megatron.training.training.get_megatron_optimizer", _get_megatron_optimizer,
            params=("config", "model_chunks", "pg_collection"))
