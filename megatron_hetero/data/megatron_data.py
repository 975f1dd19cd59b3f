"""The shapes dataset as megatron.training reads it: one dict of tensors per sample, batched by
Megatron's data loader (in a heterogeneous run, into global microbatches: patches/hetero_data.py).

Per sample: the fused sequence's `input_ids`, `labels`, `loss_mask` [S], and for each encoder kind of
the layout its item (`images` [1, 3, H, W] or `audio` [1, mel, frames]) and `<kind>_positions`, the
sequence positions its rows fill (the boundary's metadata, so every rank plans the same routes): the
format of data/sample_batch.py.
"""

import torch

from megatron_hetero.data.batches import caption_batch
from megatron_hetero.data.sample_batch import Media, SampleBatch
from megatron_hetero.data.shapes import ShapesDataset
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.kinds import EncoderKind
from megatron_hetero.models.sizes import ModelSizes


class CaptionSamples(torch.utils.data.Dataset):
    """`num_samples` samples of one split (indices wrap around the split)."""

    def __init__(self, shapes: ShapesDataset, sizes: ModelSizes, kinds: list[EncoderKind], num_samples: int,
                 with_captions: bool = True):
        self.shapes, self.sizes, self.kinds = shapes, sizes, kinds
        self.num_samples, self.with_captions = num_samples, with_captions
        self.tokenizer = CaptionTokenizer()

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        return samples_dict(self.shapes, [int(index) % len(self.shapes)], self.sizes, self.kinds,
                            self.tokenizer, self.with_captions, squeeze=True)


def samples_dict(shapes: ShapesDataset, indices: list[int], sizes: ModelSizes, kinds: list[EncoderKind],
                 tokenizer: CaptionTokenizer, with_captions: bool = True, squeeze: bool = False) -> dict:
    """The model's arguments for shapes[indices] (SampleBatch.model_kwargs: one item of each kind per
    sample); one sample's, without the batch dimension, with squeeze."""
    names = {kind.name for kind in kinds}
    clip = sizes.tokens_per_clip if "audio" in names else 0
    batch = caption_batch(shapes, indices, tokenizer, sizes.patches_per_image, sizes.seq_length,
                          with_captions, tokens_per_clip=clip)
    everything, one_each = slice(0, len(indices)), torch.ones(len(indices), dtype=torch.long)
    items = {"vision": batch.images, "audio": batch.audio}
    media = {kind.name: Media(items[kind.name](everything), one_each,
                              torch.from_numpy(batch.boundaries[kind.name].positions))
             for kind in kinds}
    out = SampleBatch(batch.input_ids, batch.labels, batch.loss_mask, media, []).model_kwargs(
        {kind.name: kind.input_key for kind in kinds})
    return {k: v[0] for k, v in out.items()} if squeeze else out
