"""The shapes dataset as megatron.training reads it: one dict of tensors per sample, batched by
Megatron's data loader (in a heterogeneous run, into global microbatches: patches/hetero_data.py).

Per sample: the fused sequence's `input_ids`, `labels`, `loss_mask` [S], and for each encoder kind of
the layout its item (`images` [3, H, W] or `audio` [mel, frames]) and `<kind>_positions`, the sequence
positions its rows fill (the boundary's metadata, so every rank plans the same routes).
"""

import torch

from megatron_hetero.data.batches import caption_batch
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
    """The model's arguments for shapes[indices] ([B, ...] tensors; one sample's without B with squeeze)."""
    names = {kind.name for kind in kinds}
    clip = sizes.tokens_per_clip if "audio" in names else 0
    batch = caption_batch(shapes, indices, tokenizer, sizes.patches_per_image, sizes.seq_length,
                          with_captions, tokens_per_clip=clip)
    out = dict(input_ids=batch.input_ids, labels=batch.labels, loss_mask=batch.loss_mask)
    everything = slice(0, len(indices))
    media = {"vision": batch.images, "audio": batch.audio}
    for kind in kinds:
        out[kind.input_key] = media[kind.name](everything)
        positions = batch.boundaries[kind.name].positions.reshape(len(indices), -1)
        out[f"{kind.name}_positions"] = torch.from_numpy(positions)
    return {k: v[0] for k, v in out.items()} if squeeze else out
