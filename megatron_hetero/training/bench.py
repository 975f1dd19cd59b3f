"""What the benchmarks (tools/bench_e2e.py, bench_mimo.py) and the planner's check
(tools/check_planner.py) share about running a workload preset on the trainer: its sizes, its
flags, its synthetic batch and its vocabulary."""

import sys
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from megatron_hetero.boundary import BoundaryBatch
from megatron_hetero.data.batches import VISION, GlobalBatch
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.layout import LayoutError
from megatron_hetero.models.sizes import ModelSizes
from megatron_hetero.planner.candidates import micro_batches
from megatron_hetero.planner.presets import BenchWorkload, trainer_workload
from megatron_hetero.training.args import ArgsError, build_parser


def sized_workload(w: BenchWorkload, layout, llm_layers: int = 0, global_batch: int = 0,
                   micro_batch: int | None = None) -> BenchWorkload:
    """The workload with the LLM depth and global batch overridden (0: the workload's) and micro
    batch `micro_batch` (None: the workload's; 0: the smallest the layout accepts: micro batch x
    LLM DP divides the global batch and splits evenly over every encoder's DP ranks)."""
    w = replace(w, layers=llm_layers or w.layers, global_batch=global_batch or w.global_batch)
    if micro_batch == 0:
        sizes = micro_batches(replace(trainer_workload(w, 1, False), micro_batch=0), (*layout.encoders, layout.llm))
        if not sizes:
            raise ArgsError(f"--global-batch {w.global_batch}: no micro batch size splits it over the LLM's DP "
                            f"{layout.llm.dp} and every encoder's DP; use a multiple of both")
        micro_batch = sizes[0]
    return replace(w, micro_batch=micro_batch or w.micro_batch)


def trainer_args(w: BenchWorkload, layout_file: str, bf16: bool):
    """The trainer's parsed flags for the workload under the layout file."""
    flags = ["--hetero-layout", layout_file, "--global-batch-size", str(w.global_batch),
             "--micro-batch-size", str(w.micro_batch), "--image-size", str(w.image_size),
             "--patch-size", str(w.patch_size), "--enc-hidden-size", str(w.enc_hidden),
             "--enc-num-layers", str(w.enc_layers), "--enc-num-attention-heads", str(w.enc_heads),
             "--hidden-size", str(w.hidden), "--num-layers", str(w.layers),
             "--num-attention-heads", str(w.heads), "--seq-length", str(w.seq_length)]
    return build_parser().parse_args(flags + (["--bf16"] if bf16 else []))


def trainer_vocab_size() -> int:
    """The padded vocabulary the trainer builds (the demo tokenizer's), whatever the workload."""
    from megatron_hetero.models.vlm import padded_vocab_size  # imports megatron-core: only when asked

    return padded_vocab_size(ModelSizes(vocab_size=CaptionTokenizer().vocab_size))


def synthetic_batch(w: BenchWorkload, tokenizer, seed: int = 0):
    """A global batch of the workload's shapes: images first in each sequence, then random text, the
    text positions carrying the loss."""
    g = torch.Generator().manual_seed(seed)
    b, s, rows = w.global_batch, w.seq_length, w.images_per_sample * w.tokens_per_image
    if 1 + rows >= s:
        raise ValueError(f"{w.name}: {rows} image tokens do not fit a {s}-token sequence")
    ids = torch.randint(tokenizer.image_id + 1, tokenizer.vocab_size, (b, s), generator=g)
    ids[:, 0], ids[:, 1 : 1 + rows] = tokenizer.bos_id, tokenizer.image_id
    labels = torch.roll(ids, -1, dims=1)
    loss_mask = torch.zeros(b, s)
    loss_mask[:, rows : s - 1] = 1.0
    images = torch.rand(b, w.images_per_sample, 3, w.image_size, w.image_size, generator=g)
    samples = [SimpleNamespace(image=images[i]) for i in range(b)]
    boundary = BoundaryBatch(np.full(b, rows), np.tile(np.arange(1, 1 + rows), b), s)
    return GlobalBatch(list(range(b)), samples, ids, labels, loss_mask, {VISION: boundary})


def run_reporting_errors(run_fn, opts) -> int:
    """run_fn(opts), a layout or argument mistake reported as one `error:` line (exit status 2)."""
    try:
        run_fn(opts)
    except (LayoutError, ArgsError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
