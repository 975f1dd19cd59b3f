"""Model building per module (megatron.training 0.19 `training.get_model`; megatron-core 0.19
`LLaVAModel`).

With `--hetero-layout` the script's model provider returns `ModelParts` (this rank's stage of each
module it holds): Megatron-LM's LLaVAModel does so through the class below, our own script directly.
get_model then treats each part as Megatron treats a model chunk, but under the module's own groups:
tensor-parallel attribute defaults, the layout's `freeze`, the device, megatron-core DDP over the
module's data-parallel (x context-parallel) group; the result is one `HeteroModel` chunk.

An encoder's rows feed the LLM's data-parallel ranks, whose losses Megatron averages over the LLM's
data-parallel size: so an encoder's DDP scales its reduced gradients by 1 / (LLM dp), not 1 / its own
dp (with --calculate-per-token-loss, gradients are summed and divided by the global token count).
"""

import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallel
from megatron.training import get_args

from megatron_hetero.patches._patch import replace
from megatron_hetero.runtime.grads import finalize_hetero_grads
from megatron_hetero.runtime.model import HeteroModel, ModelParts
from megatron_hetero.training.layout_args import fail


def _scale_reduced_gradients(ddp: DistributedDataParallel, factor: float) -> None:
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        for bucket in buffer.buckets:
            bucket.gradient_scaling_factor = factor


def wrap_parts(run, built: ModelParts, args) -> HeteroModel:
    from megatron.training.training import get_megatron_ddp_config

    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    for name, module in run.modules.items():
        if not module.held:
            continue
        part = built.parts[name]
        for param in part.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        if module.layout.freeze:
            part.requires_grad_(False)
        part.to(device)
        if args.bf16:  # bf16 weights; megatron-core's optimizer keeps fp32 main copies
            part.bfloat16()
        module.part = part
        if not any(p.requires_grad for p in part.parameters()):
            continue
        ddp_config = get_megatron_ddp_config(args)  # one each: DDP sets some of its fields
        # finalize_hetero_grads checks each module's gradients itself, naming the module (DDP's own
        # check names a bucket only).
        ddp_config.check_for_nan_in_grad = False
        module.ddp = DistributedDataParallel(part.config, ddp_config, part, pg_collection=module.pgs)
        if module.layout.role == "encoder" and not args.calculate_per_token_loss:
            _scale_reduced_gradients(module.ddp, 1.0 / run.layout.llm.dp)
    model = HeteroModel(run, built.adapter)
    model.config.finalize_model_grads_func = finalize_hetero_grads
    model.check_for_nan_in_grad = args.check_for_nan_in_loss_and_grad
    run.model = model
    return model


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
                 f"split into modules; --hetero-layout supports Megatron-LM's pretrain_vlm.py (LLaVAModel) "
                 f"and examples/pretrain_vlm.py")
        return [wrap_parts(run, built, args)]
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
