"""The reference model's providers for megatron.training: the model provider (this rank's parts of
families/parts.py, with its adapter), the conversation dataset of --data-path, the forward step and
the loss function. examples/pretrain_vlm.py
hands them to `pretrain()`; the benchmarks (benchmarks/bench.py) to `setup_model_and_optimizer()` and
`train_step()`."""

import os
from functools import partial

import torch
from megatron.training import get_args

from megatron_hetero.data.conversations import ConversationSamples, ConversationSpec
from megatron_hetero.data.images import ImageSpec
from megatron_hetero.data.media import TileImages
from megatron_hetero.families import family_named
from megatron_hetero.families.parts import build_vlm_parts
from megatron_hetero.models.kinds import ENCODER_KINDS
from megatron_hetero.models.specs import kernel_summaries
from megatron_hetero.training.args import image_normalization, model_description, model_sizes, tokenizer


def megatron_config_fields(args) -> dict:
    """The TransformerConfig fields every module takes from Megatron's own flags, as
    core_transformer_config_from_args would: --gradient-accumulation-fusion (weight gradients
    accumulate into DDP's main_grad in the GEMM, for parts DDP wraps), activation recomputation
    (--recompute-granularity full|selective, --recompute-method uniform|block,
    --recompute-num-layers, --recompute-modules), the LLM's loss (--cross-entropy-loss-fusion,
    --cross-entropy-fusion-impl: megatron-core's fused vocabulary-parallel cross entropy), the bias,
    dropout and residual add after each attention and MLP as one kernel (models/residual_add.py; on by
    default, --no-bias-dropout-fusion; off without a GPU: patches/startup.py) and the flags of the layers'
    kernel policy (--attention-backend, --flash-attention-version, --transformer-impl:
    models/kernel_policy.py)."""
    return dict(gradient_accumulation_fusion=args.gradient_accumulation_fusion,
                bias_dropout_fusion=args.bias_dropout_fusion,
                cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
                cross_entropy_fusion_impl=args.cross_entropy_fusion_impl,
                recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
                recompute_num_layers=args.recompute_num_layers, recompute_modules=args.recompute_modules,
                attention_backend=args.attention_backend, flash_attention_version=args.flash_attention_version,
                transformer_impl=args.transformer_impl)


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None, **_):
    args = get_args()
    parts = build_vlm_parts(args.hetero_run, model_sizes(args), args.seed, args.ablate_vision, args.params_dtype,
                            packed=args.pack_samples > 1, config_fields=megatron_config_fields(args))
    report_kernels(args.hetero_run, parts.parts)
    return parts


def report_kernels(run, parts: dict) -> None:
    """Start-up lines per module, from its first rank: the kernels its layers run (attention, norms,
    MLPs, experts); the loss's from the first rank of the LLM's last stage, which computes it."""
    for name, part in parts.items():
        module = run.modules[name]
        coords = module.coords()
        if any(value for axis, value in coords.items() if axis != "pp"):
            continue
        for kind, summary in kernel_summaries(part).items():
            loss_here = kind == "loss" and module.last_stage and summary != "none"
            if loss_here or (kind != "loss" and coords["pp"] == 0):
                print(f"{kind}: {name}: {summary}", flush=True)


def image_processing(args, sizes):
    """What an image of --data-path becomes: the model family's processing with the image processor
    settings of --model-sizes (the model's), else the reference encoder's tiles."""
    if sizes.family:
        description = model_description(args)
        return family_named(sizes.family).media(sizes, description["processor"], description["hf"]["config"])
    vision = ENCODER_KINDS["vision"]
    return TileImages(ImageSpec(sizes.image_size, args.max_tiles, image_normalization(args, sizes)),
                      vision.tokens_per_item(sizes), vision.item_shape(sizes)[0])


def conversation_dataset(args, num_samples: int) -> ConversationSamples:
    """--data-path's samples; only ranks holding a vision encoder's first stage decode images and
    videos, an audio encoder's audio features (their DP rank's share; all of them for an encoder
    batched over microbatches, whose items are balanced over a group of microbatches that one
    microbatch's collate does not see)."""
    sizes, path = model_sizes(args), args.data_path[0]
    vision, audio = ENCODER_KINDS["vision"], ENCODER_KINDS["audio"]
    shares = {kind: tuple((m.layout.dp, m.coords()["dp"]) if m.layout.microbatches == 1 else (1, 0)
                          for m in args.hetero_run.encoders.values() if m.first_stage and m.layout.kind == kind)
              for kind in ("vision", "audio")}
    spec = ConversationSpec(path, args.image_root or os.path.dirname(path), args.seq_length,
                            image_processing(args, sizes), decode_shares=shares["vision"],
                            encoder_width=vision.hidden_size(sizes), pack_samples=args.pack_samples,
                            audio_shares=shares["audio"], audio_width=audio.hidden_size(sizes))
    return ConversationSamples(spec, tokenizer(args), num_samples, vision.input_key)


LOSS_KEY = "lm loss"  # the loss's name in Megatron's report (train_step's loss dict), as pretrain_gpt's


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """(sum of token losses, number of loss tokens, Megatron's report) of one microbatch."""
    mask = loss_mask.float()
    loss = (output.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {LOSS_KEY: torch.stack([loss.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    output, loss_mask = model(**next(data_iterator))
    return output, partial(loss_func, loss_mask)
