"""Command-line flags of the pretrain scripts (Megatron-style names; `@file` argument files work)."""

import argparse
from dataclasses import fields

from megatron_hetero.data.shapes import all_captions
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.sizes import ModelSizes


class ArgsError(ValueError):
    """A flag value that cannot work; one line naming the flag and the fix."""


class _Parser(argparse.ArgumentParser):
    def convert_arg_line_to_args(self, arg_line):
        # Several flags per line, '#' comments: argument files read like shell scripts.
        return arg_line.split("#", 1)[0].split()


def add_hetero_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags megatron-hetero adds to a pretrain script."""
    group = parser.add_argument_group("megatron-hetero")
    group.add_argument("--hetero-layout", required=True, metavar="FILE",
                       help="YAML file declaring each module's layout (see README)")
    group.add_argument("--ablate-vision", action="store_true",
                       help="zero the encoder rows at the boundary (control run)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(description="Train a vision encoder + LLM with per-module layouts",
                     fromfile_prefix_chars="@")
    add_hetero_args(parser)
    train = parser.add_argument_group("training")
    train.add_argument("--train-iters", type=int, default=100)
    train.add_argument("--global-batch-size", type=int, default=32)
    train.add_argument("--micro-batch-size", type=int, default=4)
    train.add_argument("--seed", type=int, default=1234)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--min-lr", type=float, default=None,
                       help="cosine-decay the learning rate to this value (default: constant)")
    train.add_argument("--lr-warmup-iters", type=int, default=0)
    train.add_argument("--weight-decay", type=float, default=0.0)
    train.add_argument("--clip-grad", type=float, default=1.0)
    train.add_argument("--bf16", action="store_true")
    train.add_argument("--use-distributed-optimizer", action="store_true",
                       help="shard each module's optimizer state over its DP (x CP) group (ZeRO-1): "
                            "gradients reduce-scattered, parameters all-gathered after the step")
    train.add_argument("--log-interval", type=int, default=1)
    train.add_argument("--metrics-file", default=None)
    train.add_argument("--eval-samples", type=int, default=0)
    train.add_argument("--data-seed", type=int, default=1234)
    model = parser.add_argument_group("model sizes")
    for f in _size_flags():
        model.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    return parser


def _size_flags():
    """ModelSizes fields set by flags (the sizes; the vocabulary comes from the tokenizer)."""
    return [f for f in fields(ModelSizes) if f.type is int and f.name not in ("vocab_size", "vocab_multiple")]


def model_sizes(args, vocab_size: int) -> ModelSizes:
    return ModelSizes(vocab_size=vocab_size, **{f.name: getattr(args, f.name) for f in _size_flags()})


ENCODER_KINDS = ("vision", "audio")


def check_trainable(layout) -> None:
    """Layouts the schedules and models here run (everything else the layout allows is served by the
    boundary, see verify_layout): encoders named by kind, encoders without CP, colocated encoders
    without PP, a trainable LLM."""
    for module in layout.encoders:
        if module.name not in ENCODER_KINDS:
            raise ArgsError(f"module {module.name}: this trainer builds encoders named "
                            f"{' or '.join(ENCODER_KINDS)}; rename the module")
        if module.cp != 1:
            raise ArgsError(f"module {module.name}: encoders train with cp=1 (a sequence is one image "
                            f"or clip); set cp: 1 and use dp for its ranks")
        if layout.placement == "colocated" and module.pp != 1:
            raise ArgsError(f"module {module.name}: a colocated encoder runs unpipelined beside every "
                            f"LLM stage; set pp: 1 and use dp or tp for its ranks")
    if layout.llm.freeze:
        raise ArgsError(f"module {layout.llm.name}: freeze is for encoders here; remove it from the llm")


def _encoder_flags(args, name: str) -> list[tuple[str, int]]:
    """Encoder `name`'s (flag, value) for its layers, hidden size and attention heads."""
    prefix = "enc" if name == "vision" else "audio"
    return [(f"{prefix}-{flag}", getattr(args, f"{prefix}_{flag.replace('-', '_')}"))
            for flag in ("num-layers", "hidden-size", "num-attention-heads")]


def _check_stages(args, layout) -> None:
    """Layers split evenly over pipeline stages; sequences split evenly over CP chunks and SP parts."""
    layers = {layout.llm.name: ("num-layers", args.num_layers)}
    layers.update({m.name: _encoder_flags(args, m.name)[0] for m in layout.encoders})
    for module in layout.modules:
        flag, n = layers[module.name]
        if n < module.pp:
            raise ArgsError(f"module {module.name}: pp={module.pp} is more pipeline stages than "
                            f"--{flag} {n}; use pp <= {n}")
        if n % module.pp:
            raise ArgsError(f"--{flag} {n} is not divisible by module {module.name}'s pp={module.pp}; "
                            f"use a multiple of {module.pp}")
    llm, seq = layout.llm, args.seq_length
    sizes = model_sizes(args, vocab_size=0)
    media = sizes.patches_per_image + (sizes.tokens_per_clip if "audio" in {m.name for m in layout.encoders} else 0)
    needed = 1 + media + max(len(CaptionTokenizer().encode(c)) for c in all_captions()) + 1
    if seq < needed:
        raise ArgsError(f"--seq-length {seq} cannot hold <bos>, {media} image/audio tokens, the longest "
                        f"caption and <eos>; use --seq-length {needed} or more")
    if seq % (2 * llm.cp):
        raise ArgsError(f"--seq-length {seq} is not divisible by 2 x the llm's cp = {2 * llm.cp} "
                        f"(load-balanced CP chunks); use a multiple of {2 * llm.cp}")
    if llm.sp and (seq // llm.cp) % llm.tp:
        raise ArgsError(f"--seq-length {seq} / cp={llm.cp} is not divisible by the llm's tp={llm.tp} "
                        f"(sequence parallelism); use a multiple of {llm.cp * llm.tp}")


def _check_sizes(args, layout) -> None:
    pairs = [("hidden-size", "num-attention-heads", args.hidden_size, args.num_attention_heads, layout.llm.tp)]
    for module in layout.encoders:
        _, (hidden_flag, hidden), (heads_flag, heads) = _encoder_flags(args, module.name)
        pairs.append((hidden_flag, heads_flag, hidden, heads, module.tp))
    for hidden_flag, heads_flag, hidden, heads, tp in pairs:
        if heads < 1 or hidden % heads:
            raise ArgsError(f"--{hidden_flag} {hidden} is not divisible by --{heads_flag} {heads}")
        if heads % tp:
            raise ArgsError(f"--{heads_flag} {heads} is not divisible by the module's tp={tp}; "
                            f"use a multiple of {tp}")
    if args.audio_frames < 4 or args.audio_frames % 4:
        raise ArgsError(f"--audio-frames {args.audio_frames} is not a positive multiple of 4 (the "
                        f"audio front end halves the frames twice)")
    if args.patch_size < 1 or args.image_size % args.patch_size:
        raise ArgsError(f"--image-size {args.image_size} is not a multiple of --patch-size {args.patch_size}")


def check_args(args, layout) -> None:
    """Batch and size arithmetic the run needs; raises ArgsError with the flag to change."""
    import torch

    if args.bf16 and not torch.cuda.is_available():
        # megatron-core's linear layers re-enter autocast in backward for CUDA only.
        raise ArgsError("--bf16 needs GPUs (megatron-core's layers run bf16 autocast on CUDA only); "
                        "drop --bf16 on CPU")
    llm_dp, encoder_dps = layout.llm.dp, [m.dp for m in layout.encoders]
    _check_sizes(args, layout)
    for name in ("train_iters", "global_batch_size", "micro_batch_size", "log_interval"):
        if getattr(args, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be at least 1")
    per_step = args.micro_batch_size * llm_dp
    if args.global_batch_size % per_step:
        raise ArgsError(
            f"--global-batch-size {args.global_batch_size} is not a multiple of "
            f"--micro-batch-size x llm dp = {per_step}; use a multiple of {per_step}"
        )
    _check_stages(args, layout)
    # Each microbatch (micro batch size x llm dp samples) is split over the encoder's DP ranks.
    for dp in encoder_dps:
        if per_step % dp:
            raise ArgsError(
                f"--micro-batch-size x llm dp = {per_step} is not divisible by the encoder's "
                f"dp={dp}; make it a multiple of {dp}"
            )
    for dp in encoder_dps:
        if args.global_batch_size % dp:
            raise ArgsError(
                f"--global-batch-size {args.global_batch_size} is not divisible by the encoder's "
                f"dp={dp}; use a multiple of {dp}"
            )
    if args.eval_samples:
        for dp in (llm_dp, *encoder_dps):
            if args.eval_samples % dp:
                raise ArgsError(f"--eval-samples {args.eval_samples} is not divisible by dp={dp}; "
                                f"use a multiple of {dp}")
