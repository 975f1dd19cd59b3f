"""Pretrain encoders (vision, audio) + an LLM with per-module layouts, through megatron.training.

    torchrun --nproc-per-node 4 examples/pretrain_vlm.py @examples/demo_args.txt

A Megatron-style script: model provider, datasets provider and forward step for megatron.training's
`pretrain()`, with megatron-hetero's patches applied first. It trains this project's reference model
(models/vlm.py: our TE-free layers) on the synthetic shapes dataset, then reports caption accuracy on
held-out images (--eval-samples). Every Megatron flag works; these are the script's own defaults.
"""

import sys
from functools import partial

import megatron_hetero.patches

megatron_hetero.patches.apply()

import torch  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.global_vars import set_global_variables  # noqa: E402

from megatron_hetero.data.megatron_data import CaptionSamples  # noqa: E402
from megatron_hetero.data.shapes import ShapesDataset  # noqa: E402
from megatron_hetero.data.tokenizer import CaptionTokenizer  # noqa: E402
from megatron_hetero.models.kinds import encoder_kind  # noqa: E402
from megatron_hetero.models.vlm_parts import build_vlm_parts  # noqa: E402
from megatron_hetero.patches.metrics import write_record  # noqa: E402
from megatron_hetero.training.args import (  # noqa: E402
    add_model_args,
    check_script_args,
    expand_arg_files,
    model_sizes,
)
from megatron_hetero.training.evaluation import evaluate_captions, report_waiting  # noqa: E402

# This script's defaults (flags given on the command line come later and win).
DEFAULT_FLAGS = [
    "--transformer-impl", "local", "--position-embedding-type", "rope",
    "--calculate-per-token-loss",  # the loss: sum over caption tokens / their number in the global batch
    "--train-iters", "100", "--global-batch-size", "32", "--micro-batch-size", "4",
    "--lr", "1e-3", "--lr-decay-style", "cosine", "--weight-decay", "0.0", "--clip-grad", "1.0",
    "--hidden-size", "64", "--num-layers", "2", "--num-attention-heads", "4", "--seq-length", "32",
    "--eval-iters", "0", "--eval-interval", "1000000", "--num-workers", "0", "--log-interval", "1",
]


def model_provider(pre_process=True, post_process=True, config=None, pg_collection=None, **_):
    args = get_args()
    return build_vlm_parts(args.hetero_run, model_sizes(args), args.seed, args.ablate_vision, args.params_dtype)


def _shapes(args, split: str) -> ShapesDataset:
    sizes = model_sizes(args)
    return ShapesDataset(args.data_seed, split, sizes.image_size, sizes.audio_mel_bins, sizes.audio_frames)


def datasets_provider(num_samples):
    args = get_args()
    kinds = [encoder_kind(m) for m in args.hetero_layout_spec.encoders]
    return CaptionSamples(_shapes(args, "train"), model_sizes(args), kinds, num_samples[0]), None, None


datasets_provider.is_distributed = True  # every rank reads its global microbatches itself


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor):
    """(sum of token losses, number of loss tokens, Megatron's report) of one microbatch."""
    mask = loss_mask.float()
    loss = (output.float() * mask).sum()
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), mask.sum()])}


def forward_step(data_iterator, model):
    output, loss_mask = model(**next(data_iterator))
    return output, partial(loss_func, loss_mask)


def main() -> None:
    sys.argv[1:] = DEFAULT_FLAGS + expand_arg_files(sys.argv[1:])
    args = parse_args(add_model_args)
    check_script_args(args)  # one `error:` line before Megatron's own validation
    validate_args(args, {"tokenizer_type": "NullTokenizer", "vocab_size": CaptionTokenizer().vocab_size,
                         # unused by this model (RoPE): only checked by Megatron
                         "max_position_embeddings": 1 << 16})
    set_global_variables(args)
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider)
    print_rank_0(report_waiting(args.hetero_run.model))
    if args.eval_samples:
        accuracy = evaluate_captions(args.hetero_run.model, model_sizes(args), _shapes(args, "heldout"),
                                     args.eval_samples)
        print_rank_0(f" caption accuracy on {args.eval_samples} held-out images: {accuracy:.3f}")
        write_record(dict(caption_accuracy=accuracy, eval_samples=args.eval_samples))


if __name__ == "__main__":
    main()
