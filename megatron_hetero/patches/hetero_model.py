"""Model building per module (megatron.training 0.19 `training.get_model`; megatron-core 0.19
`LLaVAModel`).

With `--hetero-layout` the script's model provider returns `ModelParts` (this rank's stage of each
module it holds): Megatron-LM's LLaVAModel does so through the class below, our own script directly.
get_model then wraps the parts as one `HeteroModel` chunk under each module's own groups
(runtime/wrap.py).
"""

import torch
from megatron.training import get_args

from megatron_hetero.patches._patch import replace
from megatron_hetero.runtime.model import ModelParts
from megatron_hetero.runtime.wrap import wrap_parts
from megatron_hetero.training.layout_args import fail


def _get_model(original):
    def get_model(model_provider_func, model_type=None, wrap_with_ddp=True, config=None, pg_collection=None):
        args = get_args()
        run = args.hetero_run
        if run is None:
            return original(model_provider_func, model_type, wrap_with_ddp=wrap_with_ddp, config=config,
                            pg_collection=pg_collection)
        if args.fp16:
            fail("--fp16 with --hetero-layout is not supported; use --bf16")
        if args.bf16 and not torch.cuda.is_available():
            fail("--bf16 needs GPUs (megatron-core's layers run bf16 on CUDA only); drop --bf16 on CPU")
        args.model_type = model_type
        try:
            built = model_provider_func(pre_process=run.llm.first_stage, post_process=run.llm.last_stage,
                                        config=config, pg_collection=run.primary.pgs)
        except ValueError as error:  # layout checks of the model family
            fail(str(error))
        if not isinstance(built, ModelParts):
            fail(f"the script's model provider built {type(built).__name__}, which megatron-hetero cannot "
                 f"split into modules; --hetero-layout supports Megatron-LM's pretrain_vlm.py (LLaVAModel), "
                 f"examples/pretrain_vlm.py, and a model provider that returns ModelParts "
                 f"(docs/guides/bring-your-own-model.md)")
        model = wrap_parts(run, built, args)
        # Megatron's level of fine-grained timers (they synchronize): our phase timers, and the waits
        # on their timeline (the writers' phase seconds, the timeline beside --metrics-file).
        model.timers.enabled = args.timing_log_level >= 2
        model.clock.spans = model.timers.spans if model.timers.enabled else None
        args.hetero_run = model.run  # the run's description with its parts (built once, here)
        return [model]
    return get_model


def _llava_class(original):
    class LLaVAModel(original):
        """Upstream's LLaVAModel; under --hetero-layout, the per-module parts of one."""

        def __new__(cls, *args, **kwargs):
            from megatron_hetero.models.llava import build_llava_parts

            run = get_args().hetero_run if _megatron_args_set() else None
            if run is None or args:
                return super().__new__(cls)
            return build_llava_parts(original, run, kwargs)

    LLaVAModel.__qualname__ = original.__qualname__
    LLaVAModel.__module__ = original.__module__
    return LLaVAModel


def _megatron_args_set() -> bool:
    from megatron.training import global_vars

    return global_vars._GLOBAL_ARGS is not None


def apply() -> None:
    replace("megatron.training.training.get_model", _get_model,
            params=("model_provider_func", "model_type", "wrap_with_ddp", "config", "pg_collection"))
    replace("megatron.core.models.multimodal.llava_model.LLaVAModel", _llava_class, kind=type)
