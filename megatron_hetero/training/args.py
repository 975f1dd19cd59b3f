"""examples/pretrain_vlm.py's own flags (beside Megatron's) and defaults, argument files, its parsing
of Megatron's arguments, and the checks of what that script can train: every mistake one line naming
the flag or field and the fix."""

import argparse
import sys
from dataclasses import fields

from megatron_hetero.data.shapes import all_captions
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.kinds import ENCODER_KINDS, UnknownKindError, encoder_kind
from megatron_hetero.models.sizes import ModelSizes

# ModelSizes fields that are Megatron's own flags; the vocabulary comes from the tokenizer.
MEGATRON_SIZE_FLAGS = ("hidden_size", "num_layers", "num_attention_heads", "seq_length")

# The script's defaults (flags given on the command line come later and win).
DEFAULT_FLAGS = [
    "--transformer-impl", "local", "--position-embedding-type", "rope",
    "--calculate-per-token-loss",  # the loss: sum over caption tokens / their number in the global batch
    "--train-iters", "100", "--global-batch-size", "32", "--micro-batch-size", "4",
    "--lr", "1e-3", "--lr-decay-style", "cosine", "--weight-decay", "0.0", "--clip-grad", "1.0",
    "--hidden-size", "64", "--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "32",
    "--eval-iters", "0", "--eval-interval", "1000000", "--num-workers", "0", "--log-interval", "1",
]


class ArgsError(ValueError):
    """A flag value that cannot work; one line naming the flag and the fix."""


def arg_file_line(line: str) -> list[str]:
    """Several flags per line, '#' comments: argument files read like shell scripts."""
    return line.split("#", 1)[0].split()


def expand_arg_files(argv: list[str]) -> list[str]:
    """`@file` arguments replaced by the flags in the file (recursively)."""
    out = []
    for arg in argv:
        if arg.startswith("@"):
            with open(arg[1:], encoding="utf-8") as f:
                out += expand_arg_files([a for line in f for a in arg_file_line(line)])
        else:
            out.append(arg)
    return out


def _own_size_fields():
    return [f for f in fields(ModelSizes) if f.name not in ("vocab_size", "vocab_multiple", *MEGATRON_SIZE_FLAGS)]


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The example script's flags: its encoders' sizes, the data, the evaluation, the control run."""
    group = parser.add_argument_group("megatron-hetero example")
    group.add_argument("--ablate-vision", action="store_true",
                       help="zero the vision rows at the boundary (control run)")
    group.add_argument("--eval-samples", type=int, default=0,
                       help="caption accuracy on this many held-out images after training")
    group.add_argument("--data-seed", type=int, default=1234)
    for f in _own_size_fields():
        group.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    return parser


def model_sizes(args) -> ModelSizes:
    names = [f.name for f in _own_size_fields()] + list(MEGATRON_SIZE_FLAGS)
    return ModelSizes(vocab_size=CaptionTokenizer().vocab_size, **{name: getattr(args, name) for name in names})


def parse_script_args(argv: list[str], validate: bool = True):
    """Megatron's arguments for the script: DEFAULT_FLAGS, then `argv` (`@file`s expanded), with the
    script's own flags. Validated (megatron_hetero.patches applied): Megatron's validation, then
    the script's checks (one `error:` line, exit 2), set as megatron.training's global args. Without
    validation, parsed only: nothing global is set (flag checks before a run)."""
    from megatron.training.arguments import parse_and_validate_args, parse_args

    from megatron_hetero.patches import arguments

    arguments.apply()  # --hetero-layout & co. join Megatron's parser
    argv_before, sys.argv = sys.argv, [sys.argv[0], *DEFAULT_FLAGS, *expand_arg_files(argv)]
    try:
        if not validate:
            return parse_args(extra_args_provider=add_model_args)
        args = parse_and_validate_args(extra_args_provider=add_model_args,
                                       args_defaults={"tokenizer_type": "NullTokenizer",
                                                      "vocab_size": CaptionTokenizer().vocab_size,
                                                      # unused by this model (RoPE): only checked by Megatron
                                                      "max_position_embeddings": 1 << 16})
    finally:
        sys.argv = argv_before
    check_script_args(args)
    return args


def check_trainable(layout) -> None:
    """Layouts the schedules and models here run (everything else the layout allows is served by the
    boundary, see verify_layout): encoders of registered kinds, without CP, colocated ones without PP,
    a trainable LLM."""
    for module in layout.encoders:
        try:
            encoder_kind(module)
        except UnknownKindError as error:
            raise ArgsError(str(error)) from None
        if module.cp != 1:
            raise ArgsError(f"module {module.name}: encoders train with cp=1 (a sequence is one image "
                            f"or clip); set cp: 1 and use dp for its ranks")
        if layout.placement == "colocated" and module.pp != 1:
            raise ArgsError(f"module {module.name}: a colocated encoder runs unpipelined beside every "
                            f"LLM stage; set pp: 1 and use dp or tp for its ranks")
    if layout.llm.freeze:
        raise ArgsError(f"module {layout.llm.name}: freeze is for encoders here; remove it from the llm")


def _check_stages(args, layout) -> None:
    """Layers split evenly over pipeline stages; sequences split evenly over CP chunks and SP parts."""
    layers = {layout.llm.name: ("num-layers", args.num_layers)}
    layers.update({m.name: encoder_kind(m).size_flags(args)[0] for m in layout.encoders})
    for module in layout.modules:
        flag, n = layers[module.name]
        if n < module.pp:
            raise ArgsError(f"module {module.name}: pp={module.pp} is more pipeline stages than "
                            f"--{flag} {n}; use pp <= {n}")
        if n % module.pp:
            raise ArgsError(f"--{flag} {n} is not divisible by module {module.name}'s pp={module.pp}; "
                            f"use a multiple of {module.pp}")
    llm, seq = layout.llm, args.seq_length
    sizes = model_sizes(args)
    media = sum(encoder_kind(m).tokens_per_item(sizes) for m in layout.encoders)
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
        _, (hidden_flag, hidden), (heads_flag, heads) = encoder_kind(module).size_flags(args)
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
    if args.eval_samples:
        for dp in (llm_dp, *encoder_dps):
            if args.eval_samples % dp:
                raise ArgsError(f"--eval-samples {args.eval_samples} is not divisible by dp={dp}; "
                                f"use a multiple of {dp}")


def check_script_args(args) -> None:
    """examples/pretrain_vlm.py's checks, after Megatron's parsing: one `error:` line and exit 2."""
    from megatron_hetero.patches.hetero_args import fail

    if args.hetero_layout is None:
        fail("--hetero-layout is required: this script trains per-module layouts (see "
             "examples/layouts/ and the README)")
    try:
        check_trainable(args.hetero_layout_spec)
        check_args(args, args.hetero_layout_spec)
    except ArgsError as error:
        fail(str(error))


__all__ = ["DEFAULT_FLAGS", "ENCODER_KINDS", "ArgsError", "add_model_args", "check_args", "check_script_args",
           "check_trainable", "expand_arg_files", "model_sizes", "parse_script_args"]
