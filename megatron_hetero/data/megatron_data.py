"""The shapes dataset as megatron.training reads it: one `Sample` per index, batched by the dataset's
`collate` (in a heterogeneous run, into global microbatches: patches/hetero_data.py) into the model
call's arguments of data/sample_batch.py.

Per sample: the fused sequence's `input_ids`, `labels`, `loss_mask` [S], and for each encoder kind
of the layout its items (images, any number per sample with --images-per-sample A-B, 0 included;
one audio clip) and the sequence positions their rows fill (the boundary's metadata, so every rank
plans the same routes).
"""

import numpy as np
import torch

from megatron_hetero.data.bad_data import SkipReport
from megatron_hetero.data.batches import AUDIO, VISION, GlobalBatch, caption_batch
from megatron_hetero.data.images import normalize
from megatron_hetero.data.sample_batch import Media, Sample, SampleBatch, pack
from megatron_hetero.data.shapes import ShapesDataset
from megatron_hetero.data.tokenizer import CaptionTokenizer
from megatron_hetero.models.kinds import EncoderKind
from megatron_hetero.spec.sizes import ModelSizes


def images_per_sample(indices, image_counts: tuple[int, int]) -> list[int]:
    """Each sample's number of images, `low`..`high` (--images-per-sample A-B), a fixed function of
    the sample index (every rank, and a resumed run, sees the same)."""
    low, high = image_counts
    hashed = (np.asarray(indices, dtype=np.uint64) * np.uint64(2654435761)) % np.uint64(2**32)
    return (low + hashed % np.uint64(high - low + 1)).astype(int).tolist()


def _images(batch: GlobalBatch, samples: slice, sizes: ModelSizes) -> torch.Tensor:
    """The batch's images in [0, 1], normalized as the vision encoder takes them (an imported one's
    image processor: VisionArch.pixel_normalization)."""
    images = batch.images(samples)
    normalization = sizes.vision_arch.pixel_normalization
    return images if normalization is None else normalize(images, normalization)


def _media(batch: GlobalBatch, kinds: list[EncoderKind], sizes: ModelSizes) -> dict[str, Media]:
    everything = slice(0, len(batch.indices))
    made = {VISION: lambda: Media(_images(batch, everything, sizes), batch.image_counts(everything),
                                  torch.from_numpy(batch.boundaries[VISION].positions)),
            AUDIO: lambda: Media(batch.audio(everything), torch.ones(len(batch.indices), dtype=torch.long),
                                 torch.from_numpy(batch.boundaries[AUDIO].positions))}
    return {kind.name: made[kind.name]() for kind in kinds}


def shapes_batch(shapes: ShapesDataset, indices: list[int], sizes: ModelSizes, kinds: list[EncoderKind],
                 tokenizer: CaptionTokenizer, with_captions: bool = True,
                 image_counts: tuple[int, int] = (1, 1)) -> SampleBatch:
    """shapes[indices] as a batch (without captions: the prompts, for generation)."""
    clip = sizes.tokens_per_clip if any(kind.name == AUDIO for kind in kinds) else 0
    batch = caption_batch(shapes, [i % len(shapes) for i in indices], tokenizer, sizes.patches_per_image,
                          sizes.seq_length, with_captions, tokens_per_clip=clip,
                          images_per_sample=images_per_sample(indices, image_counts))
    return SampleBatch(batch.input_ids, batch.labels, batch.loss_mask, _media(batch, kinds, sizes), [])


def samples_dict(shapes: ShapesDataset, indices: list[int], sizes: ModelSizes, kinds: list[EncoderKind],
                 tokenizer: CaptionTokenizer, with_captions: bool = True,
                 image_counts: tuple[int, int] = (1, 1)) -> dict:
    """The model's arguments for shapes[indices] (SampleBatch.model_kwargs)."""
    return shapes_batch(shapes, indices, sizes, kinds, tokenizer, with_captions, image_counts).model_kwargs(
        {kind.name: kind.input_key for kind in kinds})


class CaptionSamples(torch.utils.data.Dataset):
    """`num_samples` samples of one split (indices wrap around the split); sample i has
    images_per_sample(i) images (the first one captioned)."""

    def __init__(self, shapes: ShapesDataset, sizes: ModelSizes, kinds: list[EncoderKind], num_samples: int,
                 image_counts: tuple[int, int] = (1, 1), pack_samples: int = 1):
        self.shapes, self.sizes, self.kinds = shapes, sizes, kinds
        self.num_samples, self.image_counts, self.pack_samples = num_samples, image_counts, pack_samples
        self.tokenizer = CaptionTokenizer()
        self.report = SkipReport()  # synthetic samples are never bad; the loader reports through it

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> Sample:
        batch = shapes_batch(self.shapes, [int(index)], self.sizes, self.kinds, self.tokenizer,
                             image_counts=self.image_counts)
        return Sample(batch.input_ids[0], batch.labels[0], batch.loss_mask[0], batch.media)

    def collate(self, samples: list[Sample]) -> dict:
        """The model call's arguments for a global microbatch (items ragged over the samples; with
        --pack-samples K, K samples per sequence)."""
        if self.pack_samples > 1:
            samples = pack(samples, self.pack_samples, self.tokenizer.pad_id)
        batch = SampleBatch.collate(samples)
        return {**batch.model_kwargs({kind.name: kind.input_key for kind in self.kinds}), "skipped": batch.skipped}
