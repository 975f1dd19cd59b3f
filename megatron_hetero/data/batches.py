"""Global batches of fused image-caption sequences (each module's DP rank takes its slice of them:
layout.dp_samples).

A sample's fused sequence is `<bos> <image>*kP caption <eos> <pad>...`: the placeholder expands to
its k images' P patch tokens each (k may be 0), whose input embeddings are the encoder rows
delivered by the boundary. With audio it is `<bos> <image>*kP <audio>*A caption <eos> <pad>...`,
the clip's A tokens at positions kP+1..kP+A. Audio positions hold the image placeholder id too: a
placeholder's text embedding is replaced by the boundary row delivered there, so which encoder fills
a position is said by the batch's per-medium boundary metadata, not by the token id (the shipped
tokenizer stays as is).
Every rank builds the batch metadata (token ids, image token positions) for the whole global batch,
so every rank computes the same boundary plan. The synthetic samples are cheap, so every rank builds
them whole (images included); a loader of real data would read only the images its rank encodes.
"""

from dataclasses import dataclass

import numpy as np
import torch

from megatron_hetero.boundary import BoundaryBatch
from megatron_hetero.data.shapes import ShapesDataset, ShapesSample
from megatron_hetero.data.tokenizer import CaptionTokenizer

# The media of a fused sequence, keys of GlobalBatch.boundaries: the rows of each come from its encoder.
VISION, AUDIO = "vision", "audio"


@dataclass
class GlobalBatch:
    """input_ids, labels, loss_mask: [B, S]; loss tokens are the caption words and <eos>.
    image_indices: the dataset images of each sample (its own first; none for a text-only sample).
    boundaries: the rows each medium's encoder sends into the sequence (VISION, and AUDIO when the
    batch has audio)."""

    indices: list[int]
    samples: list[ShapesSample]
    image_indices: list[list[int]]
    dataset: ShapesDataset
    input_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    boundaries: dict[str, BoundaryBatch]

    def images(self, samples: slice) -> torch.Tensor:
        """[n, 3, H, W]: the images of samples[samples], in sample order (any number per sample)."""
        size = self.dataset.image_size
        images = [self.dataset[i].image for each in self.image_indices[samples] for i in each]
        return torch.stack(images) if images else torch.zeros(0, 3, size, size)

    def image_counts(self, samples: slice) -> torch.Tensor:
        return torch.tensor([len(each) for each in self.image_indices[samples]], dtype=torch.long)

    def audio(self, samples: slice) -> torch.Tensor:
        """[n, mel_bins, frames]: the clips of samples[samples], in sample order (one per sample)."""
        return torch.stack([s.audio for s in self.samples[samples]])


def sample_images(index: int, count: int, num_images: int) -> list[int]:
    """The dataset images of a sample of `count` images: its own, then others spread over the
    dataset (the caption describes the first)."""
    return [(index + 7919 * j) % num_images for j in range(count)]


def caption_batch(
    dataset: ShapesDataset,
    indices: list[int],
    tokenizer: CaptionTokenizer,
    patches_per_image: int,
    seq_len: int,
    with_captions: bool = True,
    tokens_per_clip: int = 0,
    images_per_sample: list[int] | None = None,
) -> GlobalBatch:
    """Fused sequences for dataset[indices]; without captions, the prompt only (for generation).
    images_per_sample: each sample's number of images (default one each; 0: a text-only sample).
    With tokens_per_clip > 0 each sample's audio clip follows its images (0: vision only)."""
    counts = [1] * len(indices) if images_per_sample is None else list(images_per_sample)
    samples = [dataset[i] for i in indices]
    image_indices = [sample_images(i, k, len(dataset)) for i, k in zip(indices, counts)]
    input_ids = torch.full((len(samples), seq_len), tokenizer.pad_id, dtype=torch.long)
    loss_mask = torch.zeros(len(samples), seq_len)
    for b, (sample, k) in enumerate(zip(samples, counts)):
        prompt = [tokenizer.bos_id] + [tokenizer.image_id] * (patches_per_image * k + tokens_per_clip)
        caption = tokenizer.encode(sample.caption) + [tokenizer.eos_id] if with_captions else []
        tokens = prompt + caption
        if len(tokens) > seq_len:
            raise ValueError(
                f"a fused sequence needs {len(tokens)} tokens but --seq-length is {seq_len}; "
                f"set --seq-length {len(tokens)} or more"
            )
        input_ids[b, : len(tokens)] = torch.tensor(tokens)
        # Position t predicts token t+1: the last media token predicts the first caption word.
        loss_mask[b, len(prompt) - 1 : len(tokens) - 1] = 1.0
    labels = torch.roll(input_ids, -1, dims=1)
    labels[:, -1] = tokenizer.pad_id
    rows = np.array(counts) * patches_per_image
    spans = {VISION: (np.ones_like(rows), rows)}
    if tokens_per_clip:
        spans[AUDIO] = (1 + rows, np.full_like(rows, tokens_per_clip))
    boundaries = {medium: BoundaryBatch(count, np.concatenate([np.arange(a, a + n) for a, n in zip(start, count)]
                                                               + [np.zeros(0, dtype=np.int64)]), seq_len)
                  for medium, (start, count) in spans.items()}
    return GlobalBatch(list(indices), samples, image_indices, dataset, input_ids, labels, loss_mask, boundaries)
