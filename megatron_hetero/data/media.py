"""What an image or a video of a conversation becomes, per model: encoder items, the tokens its
`<image>` / `<video>` tag expands to, its pixels and (M-RoPE models) the sequence's position ids.

Every rank computes `items` and the tokens from the image's size (a video's metadata) alone (the
boundary plan needs every sample's positions, and every rank must skip the same samples); only ranks
that encode an image or a video decode its pixels. `TileImages` is this project's reference model's
(fixed-size tiles, one `<image>` token per row); a VLM family supplies its own (families/*/media.py),
videos too where its model takes them (`video_items`, `video_pixels`: a video is items of the same encoder, its frames
picked from its metadata, data/video.py).
"""

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megatron_hetero.data.images import ImageSpec, load_tiles, tiles_of
from megatron_hetero.data.sample_batch import Media


@dataclass(frozen=True)
class ImageItems:
    """An image's encoder items: rows each sends into the LLM sequence, tokens each runs through the
    encoder (its cost), and for native-resolution items each one's (t, h, w) patch grid (None:
    fixed-size items)."""

    rows: tuple[int, ...]
    tokens: tuple[int, ...]
    grids: tuple[tuple[int, int, int], ...] | None = None
    # what its tag expands to, where the kind's ImageTokens do not say it: text (a str, tokenized with
    # the text before it) and token ids (a tuple) in turn, the placeholders among the ids
    expansion: tuple[str | tuple[int, ...], ...] | None = None

    def spans(self) -> tuple[tuple[int, int, int], ...]:
        """The (t, h, w) patch grid of each run of placeholders its tag expands to (M-RoPE)."""
        return self.grids


@dataclass(frozen=True)
class VideoItems(ImageItems):
    """A video's items (one per video for the Qwen families): beside ImageItems', the frames it
    keeps (their indices), each placeholder run's grid (`runs`: a Qwen3-VL video's temporal patches
    are runs of their own) and, where positions say time by spacing, the seconds per temporal patch."""

    frames: tuple[int, ...] = ()
    runs: tuple[tuple[int, int, int], ...] = ()
    seconds_per_grid: float | None = None

    def spans(self) -> tuple[tuple[int, int, int], ...]:
        return self.runs


@dataclass(frozen=True)
class ImageTokens:
    """An `<image>` tag as tokens: `prefix`, then `placeholder` once per row (the positions the
    boundary fills with the encoder's rows), then `suffix`; `others`: the placeholders of the same
    encoder's other media (a video's), which their items' expansions hold."""

    prefix: tuple[int, ...]
    placeholder: int
    suffix: tuple[int, ...] = ()
    others: tuple[int, ...] = ()

    @property
    def placeholders(self) -> tuple[int, ...]:
        return (self.placeholder, *self.others)


class ImageProcessing(Protocol):
    """A model's image processing for conversation data (see the module docstring)."""

    def items(self, width: int, height: int) -> ImageItems:
        """The items of an image of this size."""

    def tokens(self, tokenizer) -> ImageTokens:
        """How an `<image>` tag expands, with this tokenizer."""

    def media(self, images: list[ImageItems], positions: torch.Tensor) -> Media:
        """A sample's Media: its images' items as NaN of the decoded shape (an item encoded undecoded
        makes the loss NaN, never wrong), their count, the positions their rows fill."""

    def item_tokens(self, media: Media) -> np.ndarray:
        """The encoder tokens of each item of a Media (their cost)."""

    def pixels(self, source) -> torch.Tensor:
        """The decoded items of an image file (a path or a file object); raises ImageError.

        A model that takes videos has `video_items(info: VideoInfo) -> VideoItems` (raises
        VideoError) and `video_pixels(source, items) -> torch.Tensor` (a video file or its frames'
        files: its items' patches) too."""

    def position_ids(self, seq_len: int, starts: list[int], items: list[ImageItems]) -> torch.Tensor | None:
        """[3, seq_len] M-RoPE position ids of a sequence whose items' placeholder runs (their
        spans, in order) start at `starts`, or None."""

    def hf_inputs(self, input_ids: torch.Tensor, media: Media, items: list[ImageItems]) -> dict:
        """A family's: transformers' forward arguments beside input_ids [1, S] for a sample's decoded
        media and its images' and videos' items (`python -m megatron_hetero.hf compare`)."""


class TileImages:
    """The reference vision encoder's: an image as one tile of `spec.size` pixels (or a grid of tiles
    plus a thumbnail), each tile `rows_per_item` rows of the tokenizer's image token."""

    def __init__(self, spec: ImageSpec, rows_per_item: int, tokens_per_item: int):
        self.spec, self.rows_per_item, self.tokens_per_item = spec, rows_per_item, tokens_per_item

    def items(self, width: int, height: int) -> ImageItems:
        n = tiles_of(width, height, self.spec)
        return ImageItems((self.rows_per_item,) * n, (self.tokens_per_item,) * n)

    def tokens(self, tokenizer) -> ImageTokens:
        return ImageTokens((), tokenizer.image_id)

    def media(self, images: list[ImageItems], positions: torch.Tensor) -> Media:
        n, size = sum(len(i.rows) for i in images), self.spec.size
        return Media(torch.full((1, 3, size, size), torch.nan).expand(n, -1, -1, -1), torch.tensor([n]), positions)

    def item_tokens(self, media: Media) -> np.ndarray:
        return np.full(len(media.items), self.tokens_per_item, dtype=np.int64)

    def pixels(self, source) -> torch.Tensor:
        return load_tiles(source, self.spec)

    def position_ids(self, seq_len: int, starts: list[int], items: list[ImageItems]) -> None:
        return None
