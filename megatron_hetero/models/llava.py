"""Megatron-LM's LLaVAModel (megatron-core 0.19 `models/multimodal/llava_model.py`) under a
heterogeneous layout: its vision model and projector form the encoder module, its language model the
LLM module, each built under its own groups; our boundary carries the image embeddings between them.

LLaVAModel already splits this way for pipelining: with `add_decoder=False` it is the vision model and
projector and returns the image embeddings [img_seq, images, h]; with `add_encoder=False` its language
part takes them through `set_input_tensor` and runs the rest of its forward unchanged (merging them at
the image token, the loss). Each part here is such an LLaVAModel. One image per sample (the mock data
of pretrain_vlm.py); the LLM with cp=1 and without sequence parallelism (LLaVAModel needs Transformer
Engine for either).
"""

import copy
import inspect

import numpy as np
import torch
import torch.distributed as dist

from megatron_hetero.boundary import BoundaryBatch, assign_items
from megatron_hetero.parallel.context import HeteroRun, ModuleRuntime
from megatron_hetero.runtime.model import ModelCall, ModelParts
from megatron_hetero.spec.layout import ModuleLayout


class LLaVALayoutError(ValueError):
    """A layout that Megatron-LM's LLaVAModel cannot run under; one line naming the fix."""


def module_config(config, layout: ModuleLayout):
    """`config` with the module's parallel sizes (the script builds every config from the LLM's)."""
    config = copy.deepcopy(config)
    config.tensor_model_parallel_size = layout.tp
    config.context_parallel_size = layout.cp
    config.pipeline_model_parallel_size = layout.pp
    config.sequence_parallel = layout.sp
    return config


def check_llava_layout(run: HeteroRun) -> None:
    encoders, llm = run.layout.encoders, run.layout.llm
    if len(encoders) != 1:
        raise LLaVALayoutError(f"Megatron-LM's LLaVAModel has one vision encoder; the layout has "
                               f"{len(encoders)} encoders: keep one")
    if encoders[0].pp != 1 or encoders[0].cp != 1:
        raise LLaVALayoutError(f"module {encoders[0].name}: LLaVAModel's vision model runs unpipelined "
                               f"and without cp; set pp: 1, cp: 1 (use dp or tp)")
    if encoders[0].microbatches != 1:
        raise LLaVALayoutError(f"module {encoders[0].name}: LLaVAModel's vision model encodes one microbatch "
                               f"a pass; set microbatches: 1")
    if llm.cp != 1 or llm.sp:
        raise LLaVALayoutError(f"module {llm.name}: LLaVAModel runs cp > 1 or sequence parallelism only "
                               f"with Transformer Engine; set cp: 1, sp: false")


def share_rng_state(src: int) -> None:
    """Every rank continues from `src`'s CPU generator: each module is then built from the stream a
    single process would be at when building it, whichever other modules a rank builds."""
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=src)
    torch.set_rng_state(state[0])


def build_llava_parts(llava_cls, run: HeteroRun, kwargs: dict) -> ModelParts:
    """This rank's parts of the LLaVAModel the script asked for (`kwargs`), built in LLaVAModel's
    order (language model, then vision model and projector)."""
    check_llava_layout(run)
    llm, (vision,) = run.llm, run.encoders.values()
    parts = {}
    if llm.held:
        parts[llm.name] = llava_cls(**{
            **kwargs, "language_transformer_config": module_config(kwargs["language_transformer_config"], llm.layout),
            "add_encoder": False, "add_decoder": True, "pre_process": llm.first_stage,
            "post_process": llm.last_stage, "pg_collection": llm.pgs})
    share_rng_state(llm.layout.first_rank)
    if vision.held:
        configs = {key: module_config(kwargs[key], vision.layout) for key in
                   ("language_transformer_config", "vision_transformer_config", "vision_projection_config")}
        parts[vision.name] = llava_cls(**{
            **kwargs, **configs, "add_encoder": True, "add_decoder": False, "pre_process": True,
            "post_process": True, "pg_collection": vision.pgs})
    return LLaVAParts(parts, LLaVAAdapter(run, parts, kwargs))


class LLaVAParts(ModelParts):
    def freeze(self, **flags) -> None:
        """LLaVAModel.freeze (the script calls it on the model it built), on every part."""
        for part in self.parts.values():
            part.freeze(**flags)


class LLaVAAdapter:
    """The script calls `model(images, input_ids, position_ids, attention_mask, labels, loss_mask,
    ...)` on a global microbatch; the LLM takes its data-parallel rank's samples, the vision model's
    data-parallel ranks take the images (one per sample) by cost (boundary.assign_items)."""

    PER_SAMPLE = ("images", "input_ids", "position_ids", "labels", "loss_mask")

    def __init__(self, run: HeteroRun, parts: dict, kwargs: dict):
        self.run = run
        self.vision = next(iter(run.encoders))
        self.hidden = kwargs["language_transformer_config"].hidden_size
        self.vision_hidden = kwargs["vision_transformer_config"].hidden_size
        self.dtype = kwargs["language_transformer_config"].params_dtype
        self.seq_length = kwargs["language_max_sequence_length"]
        self.img_seq_len = next(iter(parts.values())).img_seq_len
        self._signature = inspect.signature(type(next(iter(parts.values()))).forward)

    def _arguments(self, call: ModelCall, share) -> dict:
        """The call's arguments for samples `share` (a slice or an index tensor), images in the
        weights' dtype."""
        bound = self._signature.bind(None, *call.args, **call.kwargs).arguments
        bound.pop("self")
        args = {k: v[share] if k in self.PER_SAMPLE and v is not None else v for k, v in bound.items()}
        if args.get("images") is not None:
            args["images"] = args["images"].to(self.dtype)
        return args

    def batch_size(self, call: ModelCall) -> int:
        return self._signature.bind(None, *call.args, **call.kwargs).arguments["input_ids"].shape[0]

    def _device(self):
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")

    def boundary_like(self) -> torch.Tensor:
        return torch.zeros(0, self.hidden, dtype=self.dtype, device=self._device())

    def stage_hidden_like(self, module: ModuleRuntime, call: ModelCall, share: slice, stage: int | None = None
                          ) -> torch.Tensor:
        assert module.name == self.run.llm.name, "the vision model is not pipelined"
        return torch.empty(self.seq_length, share.stop - share.start, self.hidden, dtype=self.dtype,
                           device=self._device())

    def boundary_batches(self, name: str, calls: list[ModelCall]) -> list[BoundaryBatch]:
        """One image per sample: its img_seq_len rows, addressed by their index in the image."""
        (call,) = calls  # check_llava_layout: one microbatch per encoder pass
        samples = self.batch_size(call)
        rows = np.full(samples, self.img_seq_len)
        item_dp = assign_items(rows, self.vision_hidden, self.run.layout.module(name).dp)
        return [BoundaryBatch(rows, np.tile(np.arange(self.img_seq_len), samples), self.img_seq_len, rows, item_dp)]

    def encoder_inputs(self, module: ModuleRuntime, share: list[tuple[ModelCall, torch.Tensor]]) -> dict:
        ((call, items),) = share
        return self._arguments(call, items)

    def encoder_forward(self, module: ModuleRuntime, share: list[tuple[ModelCall, torch.Tensor]], x):
        embeddings, _ = module.part(**x)  # [img_seq, n, h]
        return embeddings.transpose(0, 1).reshape(-1, embeddings.shape[-1])

    def llm_forward(self, module: ModuleRuntime, call: ModelCall, share: slice, media: dict, hidden):
        if module.first_stage:
            hidden = media[self.vision].rows.view(share.stop - share.start, self.img_seq_len, -1).transpose(0, 1)
        module.part.set_input_tensor(hidden)
        return module.part(**self._arguments(call, share))
