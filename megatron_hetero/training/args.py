"""examples/pretrain_vlm.py's own flags (beside Megatron's) and defaults, argument files, its parsing
of Megatron's arguments, and the checks of what that script can train (the rules of
megatron_hetero.spec.rules applied to its flags): every mistake one line naming the flag or field and the fix."""

import argparse
import functools
import os
import sys
from dataclasses import fields, replace

from megatron_hetero.data.chat import TokenizerError, chat_tokenizer
from megatron_hetero.data.energon import META as ENERGON_META
from megatron_hetero.data.energon import is_energon_dataset
from megatron_hetero.data.images import NORMALIZATION
from megatron_hetero.data.shapes import all_captions
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.families import (
    REGISTRY,
    UnknownFamilyError,
    encoder_cp_tokens,
    encoder_stage_problem,
    family_named,
)
from megatron_hetero.models.kinds import ENCODER_KINDS, UnknownKindError, encoder_kind
from megatron_hetero.spec import rules
from megatron_hetero.spec.arg_files import expand_arg_files
from megatron_hetero.spec.sizes import LLMArch, ModelSizes, MoEArch, read_model_description, sizes_from_dict
from megatron_hetero.training.layout_args import ArgsError, add_hetero_flags, check_kernels, fail, load

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


def _own_size_fields():
    """ModelSizes' integer sizes that are not Megatron flags (the vocabulary comes from the tokenizer;
    the architecture fields from imported weights)."""
    return [f for f in fields(ModelSizes)
            if f.type is int and f.name not in ("vocab_size", "vocab_multiple", *MEGATRON_SIZE_FLAGS)]


# What each of the reference model's own size flags sets (the LLM's are Megatron's own flags).
_SIZE_HELP = {"image_size": "image side in pixels", "patch_size": "ViT patch side in pixels",
              "enc_hidden_size": "vision encoder width", "enc_num_layers": "vision encoder layers",
              "enc_num_attention_heads": "vision encoder attention heads", "audio_mel_bins": "mel bins per audio frame",
              "audio_frames": "frames per audio clip", "audio_hidden_size": "audio encoder width",
              "audio_num_layers": "audio encoder layers", "audio_num_attention_heads": "audio encoder attention heads"}


def add_model_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The example script's flags: its encoders' sizes, the data, the evaluation, the control run."""
    group = parser.add_argument_group("megatron-hetero example")
    group.add_argument("--ablate-vision", action="store_true",
                       help="zero the vision rows at the boundary (control run)")
    group.add_argument("--eval-samples", type=int, default=0,
                       help="caption accuracy on this many held-out images after training")
    group.add_argument("--data-seed", type=int, default=1234,
                       help="seed of the synthetic shapes data and of the held-out evaluation images (default 1234)")
    group.add_argument("--image-root", default=None,
                       help="the directory image and video paths of --data-path are relative to (default: the "
                            "file's own)")
    group.add_argument("--strict-data", action="store_true",
                       help="stop at the first bad sample (one line naming file and sample) instead of skipping it")
    group.add_argument("--image-normalization", choices=tuple(NORMALIZATION), default=None,
                       help="the vision encoder's pixel normalization; default: the encoder's own (an "
                            "imported tower's image processor's, recorded by `hf import`; none: pixels in "
                            "[0, 1], as the reference encoder takes them)")
    group.add_argument("--images-per-sample", default=None, metavar="N|A-B",
                       help="images per sample of the shapes data: N, or A to B varying by sample (0: "
                            "text-only samples); default 1")
    group.add_argument("--pack-samples", type=int, default=1, metavar="K",
                       help="sequence packing: K samples back to back in each LLM sequence of --seq-length "
                            "(attention within each); --micro-batch-size counts samples, a multiple of K")
    group.add_argument("--max-tiles", type=int, default=1,
                       help="split a larger image into up to this many tiles plus a thumbnail (1: no tiling)")
    for f in _own_size_fields():
        group.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default,
                           help=f"the reference model's {_SIZE_HELP.get(f.name, f.name)} (default {f.default})")
    group.add_argument("--model-sizes", default=None,
                       help="a model description (the model.json `megatron-hetero hf import` "
                            "writes): sizes and architecture of every module, over the size flags")
    return parser


def tokenizer(args):
    """The tokenizer of --tokenizer-type / --tokenizer-model (data/chat.py); a model family's names
    its own image tokens (no `<image>` token needed)."""
    try:
        return chat_tokenizer(args.tokenizer_type, args.tokenizer_model, not model_family(args))
    except (TokenizerError, OSError) as error:
        raise ArgsError(f"--tokenizer-model {args.tokenizer_model}: {error}") from None


def _first(value):
    """Megatron keeps a one-element `nargs='+'` flag as a list until its validation unwraps it."""
    return value[0] if isinstance(value, list) else value


def moe_arch(args) -> MoEArch | None:
    """The LLM's MoE layers from Megatron's flags (--num-experts & co.); None without --num-experts."""
    if args.num_experts is None:
        return None
    return MoEArch(num_experts=args.num_experts, topk=args.moe_router_topk,
                   ffn_hidden_size=args.moe_ffn_hidden_size, aux_loss_coeff=_first(args.moe_aux_loss_coeff),
                   z_loss_coeff=args.moe_z_loss_coeff, dispatcher=args.moe_token_dispatcher_type)


@functools.lru_cache(maxsize=4)
def _description_file(path: str) -> dict:
    try:
        return read_model_description(path, f"--model-sizes {path}")
    except ValueError as error:
        raise ArgsError(f"{error}; give the model.json written by `megatron-hetero hf import`") from None


def _sizes_file(path: str) -> ModelSizes:
    return sizes_from_dict(_description_file(path)["sizes"])


def model_description(args) -> dict:
    """The whole model.json of --model-sizes (a family's image processor settings and Hugging Face
    config beside the sizes)."""
    return _description_file(args.model_sizes)


def model_family(args) -> str:
    """The VLM family of --model-sizes ("": this project's reference model)."""
    return _sizes_file(args.model_sizes).family if args.model_sizes else ""


def model_sizes(args) -> ModelSizes:
    if args.model_sizes:  # the sequence length is the run's; the rest the described model's
        return replace(_sizes_file(args.model_sizes), seq_length=args.seq_length)
    names = [f.name for f in _own_size_fields()] + list(MEGATRON_SIZE_FLAGS)
    return ModelSizes(vocab_size=tokenizer(args).vocab_size, vocab_multiple=args.make_vocab_size_divisible_by,
                      llm_arch=LLMArch(moe=moe_arch(args)),
                      **{name: getattr(args, name) for name in names})


def _take_sizes_file(args) -> None:
    """--model-sizes sets the size flags (Megatron's and ours), so every check sees the model's."""
    sizes = _sizes_file(args.model_sizes)
    for name in [f.name for f in _own_size_fields()] + [n for n in MEGATRON_SIZE_FLAGS if n != "seq_length"]:
        setattr(args, name, getattr(sizes, name))
    moe = sizes.llm_arch.moe
    if moe is not None:  # Megatron's MoE flags (moe_arch's inverse): the experts are the model's
        for name, value in (("num_experts", moe.num_experts), ("moe_router_topk", moe.topk),
                            ("moe_ffn_hidden_size", moe.ffn_hidden_size), ("moe_aux_loss_coeff", moe.aux_loss_coeff),
                            ("moe_z_loss_coeff", moe.z_loss_coeff), ("moe_token_dispatcher_type", moe.dispatcher)):
            setattr(args, name, value)
    vocab = tokenizer(args).vocab_size
    if vocab > sizes.vocab_size:
        raise ArgsError(f"--model-sizes {args.model_sizes}: a vocabulary of {sizes.vocab_size} is smaller than "
                        f"the tokenizer's {vocab}")


def parse_script_args(argv: list[str], validate: bool = True):
    """Megatron's arguments for the script: DEFAULT_FLAGS, then `argv` (`@file`s expanded), with the
    script's own flags and megatron-hetero's. Validated (the script applies megatron_hetero.patches
    first, whose validation takes --hetero-layout): the script's checks first (one `error:` line,
    exit 2), then Megatron's validation, set as megatron.training's global args. Without validation,
    parsed only: nothing global is set (flag checks before a run)."""
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_global_variables

    argv_before, sys.argv = sys.argv, [sys.argv[0], *DEFAULT_FLAGS, *expand_arg_files(argv)]
    try:
        args = parse_args(extra_args_provider=lambda parser: add_model_args(add_hetero_flags(parser)))
    finally:
        sys.argv = argv_before
    if not validate:
        return args
    check_script_args(args)
    validate_args(args, {"tokenizer_type": "NullTokenizer", "vocab_size": tokenizer(args).vocab_size,
                         # unused by this model (RoPE): only checked by Megatron
                         "max_position_embeddings": 1 << 16})
    set_global_variables(args)
    return args


def check_trainable(layout) -> None:
    """Layouts the schedules and models here run (everything else the layout allows is served by the
    boundary, see verify_layout): encoders of registered kinds, colocated ones without PP, a
    trainable LLM (an encoder's CP against its item size: check_args)."""
    for module in layout.encoders:
        try:
            encoder_kind(module)
        except UnknownKindError as error:
            raise ArgsError(str(error)) from None
        rules.check(ArgsError, rules.encoder_pp_problem(module, layout.placement))
    rules.check(ArgsError, rules.llm_freeze_problem(layout.llm))


def image_counts(args) -> tuple[int, int]:
    """--images-per-sample as (fewest, most)."""
    text = args.images_per_sample or "1"
    low, _, high = text.partition("-")
    try:
        counts = int(low), int(high or low)
    except ValueError:
        counts = (-1, -1)
    if not 0 <= counts[0] <= counts[1]:
        raise ArgsError(f"--images-per-sample {text}: give a count N or a range A-B with 0 <= A <= B")
    return counts


def _check_stages(args, layout) -> None:
    """Layers split evenly over pipeline stages; sequences fit a sample and split evenly over CP
    chunks and SP parts; an encoder's items over its CP ranks."""
    layers = {layout.llm.name: ("num-layers", args.num_layers)}
    layers.update({m.name: encoder_kind(m).size_flags(args)[0] for m in layout.encoders})
    for module in layout.modules:
        flag, n = layers[module.name]
        rules.check(ArgsError, rules.stages_problem(module, n, f"--{flag}"))
    rules.check(ArgsError, rules.sequence_problem(args.seq_length, layout.llm))
    for module in layout.encoders:
        rules.check(ArgsError, rules.encoder_cp_problem(module, encoder_cp_tokens(module, model_sizes(args)),
                                                        f" ({encoder_kind(module).item_flags})"))
    if args.data_path or model_family(args):  # a sample longer than --seq-length is skipped (data/conversations.py)
        return
    sizes = model_sizes(args)
    items = {"vision": image_counts(args)[1]}  # the most images; one clip
    media = sum(encoder_kind(m).tokens_per_item(sizes) * items.get(encoder_kind(m).name, 1) for m in layout.encoders)
    caption = max(len(CaptionTokenizer().encode(c)) for c in all_captions())
    rules.check(ArgsError, rules.prompt_problem(args.seq_length, media, caption, args.pack_samples))


def image_normalization(args, sizes: ModelSizes) -> tuple:
    """The (mean, std) --data-path images are normalized with: the vision encoder's (recorded at its
    import), else --image-normalization's (default none); a flag naming other constants than the
    encoder's is an error."""
    own, flag = sizes.vision_arch.pixel_normalization, args.image_normalization
    if own is None:
        return NORMALIZATION[flag or "none"]
    if flag is not None and NORMALIZATION[flag] != own:
        raise ArgsError(f"--image-normalization {flag} conflicts with the vision encoder's own normalization "
                        f"(mean {list(own[0])}, std {list(own[1])}, recorded at its import in --model-sizes); "
                        f"drop the flag")
    return own


def _check_data(args, layout) -> None:
    """--data-path names one conversation file or energon dataset (images and videos, for the vision
    encoder); held-out captions need the shapes tokenizer."""
    tokenizer(args)
    if args.eval_samples and args.tokenizer_type not in (None, "NullTokenizer"):
        raise ArgsError(f"--eval-samples captions held-out shapes with the shipped tokenizer; drop it or "
                        f"--tokenizer-type {args.tokenizer_type}")
    image_counts(args)
    if not args.data_path:
        if args.tokenizer_type not in (None, "NullTokenizer"):
            raise ArgsError(f"--tokenizer-type {args.tokenizer_type} needs --data-path: the shapes data is "
                            f"tokenized with the shipped tokenizer")
        return
    if args.images_per_sample is not None:
        raise ArgsError("--images-per-sample sets the shapes data's images; a conversation file (--data-path) "
                        "says each sample's own: drop it")
    if len(args.data_path) == 1 and os.path.isdir(args.data_path[0]):
        if not is_energon_dataset(args.data_path[0]):
            raise ArgsError(f"--data-path {args.data_path[0]}: a directory without {ENERGON_META}/, not a prepared "
                            f"energon dataset; run `energon prepare {args.data_path[0]}` or give a .json file")
    elif len(args.data_path) != 1 or not args.data_path[0].endswith((".json", ".jsonl")):
        raise ArgsError(f"--data-path {' '.join(args.data_path)}: give one conversation .json or .jsonl file "
                        f"(LLaVA or ShareGPT records) or one megatron-energon dataset directory")
    family = model_family(args)
    audio = bool(family) and family in REGISTRY and bool(family_named(family).audio_builder)
    for module in layout.encoders:
        if encoder_kind(module).name != "vision" and not (audio and encoder_kind(module).name == "audio"):
            raise ArgsError(f"--data-path: conversation data carries images and videos (and audio for a model with "
                            f"an audio encoder) only; module {module.name} is a {module.kind} encoder (drop it from "
                            f"the layout or train on the shapes data)")
    if args.max_tiles < 1:
        raise ArgsError("--max-tiles must be at least 1")


def _check_sizes(args, layout) -> None:
    sizes = [(layout.llm, ("hidden-size", args.hidden_size), ("num-attention-heads", args.num_attention_heads))]
    sizes += [(m, *encoder_kind(m).size_flags(args)[1:]) for m in layout.encoders]

    def name(flag: str) -> str:  # a described model's sizes are its model.json's, not flags
        return f"{args.model_sizes}'s {flag.replace('-', '_')}" if args.model_sizes else f"--{flag}"

    for module, (hidden_flag, hidden), (heads_flag, heads) in sizes:
        rules.check(ArgsError, rules.head_width_problem(hidden, name(hidden_flag), heads, name(heads_flag)),
                    rules.heads_problem(module, heads, name(heads_flag)))
    rules.check(ArgsError, rules.audio_frames_problem(args.audio_frames))
    if not model_family(args):  # a family's images have no one size
        rules.check(ArgsError, rules.patch_problem(args.image_size, args.patch_size))


def _check_family(args, layout) -> None:
    """A VLM family's model (--model-sizes of a whole-model import): known to this version, trained
    on conversation data with its Hugging Face tokenizer (holding the family's image tokens), its
    vision tower one pipeline stage unless the family's splits into stages, and its images as its
    image processor makes them."""
    family = model_family(args)
    if not family:
        return
    try:
        family_named(family)
    except UnknownFamilyError as error:
        raise ArgsError(f"--model-sizes {args.model_sizes}: {error}") from None
    sizes = model_sizes(args)
    rules.check(ArgsError, *(encoder_stage_problem(module, sizes) for module in layout.encoders))
    if family_named(family).audio_builder and not any(m.kind == "audio" for m in layout.encoders):
        raise ArgsError(f"a {family} model has an audio encoder: add a module `audio: {{role: encoder}}` and the "
                        f"edge audio -> {layout.llm.name} to the layout")
    vision = next((m.name for m in layout.encoders if m.kind == "vision"), "vision")
    deepstack = family_named(family).deepstack(sizes)
    rules.check(ArgsError, rules.deepstack_problem(layout, vision, deepstack))
    if deepstack and args.recompute_granularity == "full":
        raise ArgsError(f"--recompute-granularity full: the {family} DeepStack rows are added between LLM layers, "
                        f"which full recomputation reruns without them; use --recompute-granularity selective")
    if args.mock_data:  # the benchmarks' own batches (benchmarks/bench.py)
        return
    if not args.data_path:
        raise ArgsError(f"--model-sizes {args.model_sizes} describes a {family} model: train it on conversation "
                        f"data (--data-path FILE); the shapes data is for the reference model")
    if args.tokenizer_type != "HuggingFaceTokenizer":
        raise ArgsError(f"a {family} model reads its data with its own tokenizer: --tokenizer-type "
                        f"HuggingFaceTokenizer --tokenizer-model <its Hugging Face directory>")
    description = model_description(args)
    try:  # the family's image tokens are the tokenizer's (InternVL's <img> and </img>)
        family_named(family).media(_sizes_file(args.model_sizes), description["processor"],
                                   description["hf"]["config"]).tokens(tokenizer(args))
    except TokenizerError as error:
        raise ArgsError(f"--tokenizer-model {args.tokenizer_model}: {error}") from None
    for flag, default in (("max_tiles", 1), ("image_normalization", None)):
        if getattr(args, flag) != default:
            raise ArgsError(f"--{flag.replace('_', '-')}: a {family} model's images are its image processor's "
                            f"(model.json); drop the flag")


def _module_head_dims(args, layout) -> dict[str, int]:
    """Every module's attention head dim (its TransformerConfig's kv_channels)."""
    sizes = model_sizes(args)
    dims = {layout.llm.name: sizes.llm_arch.head_dim or args.hidden_size // args.num_attention_heads}
    for module in layout.encoders:
        (_, _), (_, hidden), (_, heads) = encoder_kind(module).size_flags(args)
        dims[module.name] = hidden // heads
    return dims


def check_args(args, layout) -> None:
    """Batch and size arithmetic the run needs; raises ArgsError with the flag to change."""
    import torch

    if args.bf16 and not torch.cuda.is_available():
        # megatron-core's linear layers re-enter autocast in backward for CUDA only.
        raise ArgsError("--bf16 needs GPUs (megatron-core's layers run bf16 autocast on CUDA only); "
                        "drop --bf16 on CPU")
    _check_family(args, layout)
    _check_sizes(args, layout)
    # Every module's head dim (the arguments patch, run by any script, knows only the LLM's).
    args.hetero_kernel_policy = check_kernels(args, lambda: _module_head_dims(args, layout))
    _check_data(args, layout)
    image_normalization(args, model_sizes(args))
    for name in ("train_iters", "global_batch_size", "micro_batch_size", "log_interval"):
        if getattr(args, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be at least 1")
    rules.check(ArgsError, rules.batch_problem(args.global_batch_size, args.micro_batch_size, layout.llm))
    microbatches = args.global_batch_size // (args.micro_batch_size * layout.llm.dp)
    rules.check(ArgsError, *(rules.encoder_microbatches_problem(e, microbatches) for e in layout.encoders))
    if args.pack_samples < 1 or args.micro_batch_size % args.pack_samples:
        raise ArgsError(f"--micro-batch-size {args.micro_batch_size} is not a multiple of --pack-samples "
                        f"{args.pack_samples} (each LLM sequence holds that many samples); use a multiple of "
                        f"{max(args.pack_samples, 1)} and --pack-samples >= 1")
    _check_stages(args, layout)
    samples = args.eval_samples
    if samples:
        rules.check(ArgsError, rules.dp_split_problem(f"--eval-samples {samples}", samples, layout.llm))


def check_script_args(args) -> None:
    """examples/pretrain_vlm.py's checks, after Megatron's parsing and before its validation: one
    `error:` line and exit 2."""
    if args.hetero_layout is None:
        fail("--hetero-layout is required: this script trains per-module layouts (see examples/layouts/ "
             "and the README)")
    try:
        if args.model_sizes:  # first: the layout's checks see the model's sizes (its experts)
            _take_sizes_file(args)
    except ArgsError as error:
        fail(str(error))
    layout = args.hetero_layout_spec = load(args)  # Megatron's validation reuses it
    try:
        check_trainable(layout)
        check_args(args, layout)
    except ArgsError as error:
        fail(str(error))


__all__ = ["DEFAULT_FLAGS", "ENCODER_KINDS", "ArgsError", "add_model_args", "check_args", "check_script_args",
           "check_trainable", "image_counts", "model_sizes", "parse_script_args"]
