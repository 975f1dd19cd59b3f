"""Pretrain encoders (vision, audio) + an LLM with per-module layouts, through megatron.training.

    torchrun --nproc-per-node 4 examples/pretrain_vlm.py @examples/demo_args.txt

A Megatron-style script: model provider, datasets provider and forward step for megatron.training's
`pretrain()`, with megatron-hetero's patches applied first (the model provider and forward step are
the package's, training/providers.py, which the benchmarks train too). It trains this project's
reference model (models/vlm.py: our TE-free layers) on LLaVA-style conversation files (--data-path,
see the README's "Data") or else the synthetic shapes dataset, then reports caption accuracy on
held-out images (--eval-samples). Every Megatron flag works; the script's own
defaults are training/args.py's DEFAULT_FLAGS.
"""

import sys

import megatron_hetero.patches

megatron_hetero.patches.apply()

from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import get_args, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import pretrain_cfg_container_from_args  # noqa: E402

from megatron_hetero.data.bad_data import DataError  # noqa: E402
from megatron_hetero.data.megatron_data import CaptionSamples  # noqa: E402
from megatron_hetero.data.shapes import ShapesDataset  # noqa: E402
from megatron_hetero.models.kinds import encoder_kind  # noqa: E402
from megatron_hetero.patches.metrics import write_record  # noqa: E402
from megatron_hetero.training.args import image_counts, model_sizes, parse_script_args  # noqa: E402
from megatron_hetero.training.evaluation import evaluate_captions, report_waiting  # noqa: E402
from megatron_hetero.training.layout_args import fail  # noqa: E402
from megatron_hetero.training.providers import conversation_dataset, forward_step, model_provider  # noqa: E402


def _shapes(args, split: str) -> ShapesDataset:
    sizes = model_sizes(args)
    return ShapesDataset(args.data_seed, split, sizes.image_size, sizes.audio_mel_bins, sizes.audio_frames)


def datasets_provider(num_samples):
    args = get_args()
    if args.data_path:
        try:
            dataset = conversation_dataset(args, num_samples[0])
        except DataError as error:
            fail(str(error))
        args.data_report = dataset.report  # filled as batches arrive, summarized after training
        return dataset, None, None
    kinds = [encoder_kind(m) for m in args.hetero_layout_spec.encoders]
    return (CaptionSamples(_shapes(args, "train"), model_sizes(args), kinds, num_samples[0], image_counts(args),
                           args.pack_samples), None, None)


datasets_provider.is_distributed = True  # every rank reads its global microbatches itself


def main() -> None:
    args = parse_script_args(sys.argv[1:])
    pretrain(pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder,
             forward_step, model_provider)
    print_rank_0(report_waiting(args.hetero_run.handles.model))
    if args.data_path:
        print_rank_0(args.data_report.summary())
    if args.eval_samples:
        accuracy = evaluate_captions(args.hetero_run.handles.model, model_sizes(args), _shapes(args, "heldout"),
                                     args.eval_samples)
        print_rank_0(f" caption accuracy on {args.eval_samples} held-out images: {accuracy:.3f}")
        write_record(dict(caption_accuracy=accuracy, eval_samples=args.eval_samples))


if __name__ == "__main__":
    main()
